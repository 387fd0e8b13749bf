"""The Qwen-Image timestep schedule, computed by diffusers' own code.

The very calls `QwenImagePipeline.__call__` makes (`trueflow.models.flow_schedule` says which, and why diffusers'
own code is used).
"""

from __future__ import annotations

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from ..flow_schedule import pipeline_schedule

from .scheduler_config import QWEN_IMAGE_SCHEDULER_CONFIG  # noqa: F401 - the config the schedule reads by default

SCHEDULE_NOTE = "Qwen-Image's scheduler stretches its sigmas to a terminal value, which takes at least 2 steps"


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
    # QwenImagePipeline's fallbacks for a config that omits a key.
    return pipeline_schedule(scheduler_config, num_steps, image_seq_len, device, (256, 4096, 0.5, 1.15),
                             calculate_shift, retrieve_timesteps, SCHEDULE_NOTE)
