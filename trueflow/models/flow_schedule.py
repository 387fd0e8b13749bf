"""The flow-matching schedule as diffusers' flow pipelines set it (Qwen-Image's, LTX-2's), by diffusers' own calls.

Both the rollout engine and the trainer take sigmas and timesteps from a family's schedule, so neither side ever
re-derives them. The pipelines' lines are: `np.linspace(1, 1/T, T)` sigmas, `calculate_shift` for the exponential
shift mu from the token count (with the pipeline's fallbacks for a config that lacks a key), then
`retrieve_timesteps` -> `set_timesteps(sigmas=, mu=)`, which may stretch the sigmas to `shift_terminal` and appends
0. Re-implementing the shift would be easy to get *almost* right: diffusers casts the float64 linspace to float32
*before* the time shift and the terminal stretch, which it evaluates in numpy float32, so a float64 re-implementation
rounds differently in the last bit. Each family passes its pipeline module's own `calculate_shift` and
`retrieve_timesteps`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from diffusers.schedulers import FlowMatchEulerDiscreteScheduler


def pipeline_schedule(scheduler_config: dict, num_steps: int, image_seq_len: int,
                      device: torch.device | str | None, shift_fallbacks: tuple[int, int, float, float],
                      calculate_shift: Callable, retrieve_timesteps: Callable,
                      note: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sigmas [T+1] fp32, timesteps [T] fp32)` as the pipeline sets them for `image_seq_len` tokens.
    `shift_fallbacks`: the pipeline's (base_image_seq_len, max_image_seq_len, base_shift, max_shift) for a config
    without them; `note`: why a step count may be refused, for the error."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
    mu = calculate_shift(image_seq_len, *(scheduler.config.get(k, d) for k, d in zip(keys, shift_fallbacks)))
    with np.errstate(invalid="ignore", divide="ignore"):  # a non-finite schedule is refused just below
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, device, sigmas=sigmas, mu=mu)
    if not torch.isfinite(scheduler.sigmas).all():
        # e.g. one step with `shift_terminal`: the stretch divides by 1 - sigmas[-1] = 0 (diffusers gives NaN)
        raise ValueError(f"this scheduler config gives a non-finite schedule for num_steps={num_steps} ({note})")
    return scheduler.sigmas, timesteps
