"""The LTX-2 timestep schedule, computed by diffusers' own code, as `LTX2Pipeline.__call__` sets it: sigmas
`np.linspace(1, 1/T, T)`, the exponential shift mu from the VIDEO token count (`latents.shape[1]`, with the
pipeline's fallbacks 1024/4096/0.95/2.05 for a config that lacks them), then `retrieve_timesteps`, which stretches the
sigmas to `shift_terminal` and appends 0. The transformer gets `timesteps[i]` (sigma x 1000, fp32) as `timestep`
AND as `sigma`; the pipeline's own velocity round trip and Euler step use `sigmas[i]`."""

from __future__ import annotations

import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

from ..flow_schedule import pipeline_schedule

SCHEDULE_NOTE = "LTX-2's scheduler stretches its sigmas to a terminal value, which takes at least 2 steps"


def ltx2_schedule(scheduler_config: dict, num_steps: int, image_seq_len: int,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sigmas [T+1] fp32, timesteps [T] fp32)` exactly as `LTX2Pipeline.__call__` sets them for a video of
    `image_seq_len` tokens (frames x rows x cols)."""
    # LTX2Pipeline's fallbacks for a config that omits a key.
    return pipeline_schedule(scheduler_config, num_steps, image_seq_len, device, (1024, 4096, 0.95, 2.05),
                             calculate_shift, retrieve_timesteps, SCHEDULE_NOTE)
