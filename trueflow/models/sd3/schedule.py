"""The SD3 timestep schedule, computed by diffusers' own code, as `StableDiffusion3Pipeline.__call__` sets it: no
sigmas passed, so `retrieve_timesteps` -> `set_timesteps(num_inference_steps)` spaces the timesteps linearly between
the scheduler's (already shifted) sigma_max and sigma_min, divides by 1000 and applies the static `shift` (3.0 for
SD3.5), then appends 0; a config with `use_dynamic_shifting` instead gets the pipeline's `mu` from the patch count
(with its fallbacks 256/4096/0.5/1.16). The transformer gets `timesteps[i]` (sigma x 1000, fp32) as `timestep`."""

from __future__ import annotations

import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps
from diffusers.schedulers import FlowMatchEulerDiscreteScheduler

from .scheduler_config import SD3_SCHEDULER_CONFIG  # noqa: F401 - the config the schedule reads by default


def sd3_schedule(scheduler_config: dict, num_steps: int, image_seq_len: int,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sigmas [T+1] fp32, timesteps [T] fp32)` exactly as `StableDiffusion3Pipeline.__call__` sets them for an
    image of `image_seq_len` patches ((h/2)·(w/2) latents)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    kwargs = {}
    if scheduler.config.get("use_dynamic_shifting", None):
        c = scheduler.config
        kwargs["mu"] = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256),
                                       c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                                       c.get("max_shift", 1.16))
    timesteps, _ = retrieve_timesteps(scheduler, num_steps, device, sigmas=None, **kwargs)
    return scheduler.sigmas, timesteps
