"""The Qwen-Image timestep schedule, computed by diffusers' own code.

Both the rollout engine and the trainer take sigmas and timesteps from here, so neither side ever
re-derives them: the schedule is built by the very calls `QwenImagePipeline.__call__` makes
(`np.linspace` sigmas, `calculate_shift` for mu, `retrieve_timesteps` → `set_timesteps(sigmas=, mu=)`).
Re-implementing the shift would be easy to get *almost* right: diffusers casts the float64
linspace to float32 *before* the exponential time shift and the terminal stretch, which it then
evaluates in numpy float32, so a float64 re-implementation rounds differently in the last bit.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.schedulers import FlowMatchEulerDiscreteScheduler

from .scheduler_config import QWEN_IMAGE_SCHEDULER_CONFIG  # noqa: F401 - the config the schedule reads by default


def qwen_image_schedule(
    scheduler_config: dict, num_steps: int, image_seq_len: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(sigmas, timesteps)` exactly as `QwenImagePipeline.__call__` sets them.

    Args:
        scheduler_config: a `FlowMatchEulerDiscreteScheduler` config (a checkpoint's
            `scheduler/scheduler_config.json`, or `QWEN_IMAGE_SCHEDULER_CONFIG`).
        num_steps: number of denoising steps.
        image_seq_len: number of packed image tokens, `(height // 16) * (width // 16)` for Qwen-Image
            (VAE factor 8, patch 2); it sets the resolution-dependent shift mu.
        device: where the tensors go (the pipeline puts them on its execution device).

    Returns:
        sigmas: fp32 `[num_steps + 1]`, from 1.0 down, ending with the appended terminal 0.
        timesteps: fp32 `[num_steps]`, `sigmas[:-1] * num_train_timesteps` (what the transformer
            receives, divided by 1000 by the pipeline).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    # The pipeline's own lines, including its fallbacks for configs that omit a key.
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    timesteps, _ = retrieve_timesteps(scheduler, num_steps, device, sigmas=sigmas, mu=mu)
    if not torch.isfinite(scheduler.sigmas).all():
        # e.g. one step with `shift_terminal`: the stretch divides by 1 - sigmas[-1] = 0 (diffusers gives NaN)
        raise ValueError(f"this scheduler config gives a non-finite schedule for num_steps={num_steps}")
    return scheduler.sigmas, timesteps
