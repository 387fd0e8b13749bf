"""The FLUX.1 timestep schedule, computed by diffusers' own code: the very calls `FluxPipeline.__call__` makes
(`trueflow.models.flow_schedule` says which, and why diffusers' own code is used): `np.linspace(1, 1/T, T)` sigmas,
`calculate_shift` of the packed image tokens with the pipeline's fallbacks (256, 4096, 0.5, 1.15), then
`retrieve_timesteps(..., sigmas=, mu=)`."""

from __future__ import annotations

import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from ..flow_schedule import pipeline_schedule


def flux_schedule(scheduler_config: dict, num_steps: int, image_seq_len: int,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sigmas [T+1] fp32, timesteps [T] fp32)` as `FluxPipeline.__call__` sets them for `image_seq_len` packed
    image tokens ((height / 16) · (width / 16)). A config with `use_flow_sigmas` (the pipeline then passes no
    sigmas) is refused."""
    if scheduler_config.get("use_flow_sigmas"):
        raise ValueError("this scheduler config sets use_flow_sigmas, for which FluxPipeline passes no sigmas; the "
                         "flux family schedules FLUX.1-dev's linspace sigmas only")
    return pipeline_schedule(scheduler_config, num_steps, image_seq_len, device, (256, 4096, 0.5, 1.15),
                             calculate_shift, retrieve_timesteps, "FluxPipeline's schedule")
