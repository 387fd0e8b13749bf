"""The LTX-2 timestep schedule, computed by diffusers' own code, as `LTX2Pipeline.__call__` sets it: sigmas
`np.linspace(1, 1/T, T)`, the exponential shift mu from the VIDEO token count (`latents.shape[1]`, with the
pipeline's fallbacks 1024/4096/0.95/2.05 for a config that lacks them), then `retrieve_timesteps`, which stretches the
sigmas to `shift_terminal` and appends 0. The transformer gets `timesteps[i]` (sigma x 1000, fp32) as `timestep`
AND as `sigma`; the pipeline's own velocity round trip and Euler step use `sigmas[i]`."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
from diffusers.schedulers import FlowMatchEulerDiscreteScheduler

SCHEDULE_NOTE = "LTX-2's scheduler stretches its sigmas to a terminal value, which takes at least 2 steps"


def ltx2_schedule(scheduler_config: dict, num_steps: int, image_seq_len: int,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sigmas [T+1] fp32, timesteps [T] fp32)` exactly as `LTX2Pipeline.__call__` sets them for a video of
    `image_seq_len` tokens (frames x rows x cols)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 1024),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.95),
        scheduler.config.get("max_shift", 2.05),
    )
    with np.errstate(invalid="ignore", divide="ignore"):  # a non-finite schedule is refused just below
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, device, None, sigmas=sigmas, mu=mu)
    if not torch.isfinite(scheduler.sigmas).all():
        # one step with `shift_terminal`: the stretch divides by 1 - sigmas[-1] = 0
        raise ValueError(f"this scheduler config gives a non-finite schedule for num_steps={num_steps} "
                         f"({SCHEDULE_NOTE})")
    return scheduler.sigmas, timesteps
