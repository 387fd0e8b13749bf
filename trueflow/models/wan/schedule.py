"""Wan2.2's RL schedule, computed by diffusers' own code: `FlowMatchEulerDiscreteScheduler` with the checkpoint's
static shift, as DanceGRPO and flow_grpo roll Wan out (the SDE/CPS/ODE steps of `trueflow.engine.samplers` on its
sigmas), and the transformer's timestep input as `WanPipeline.__call__` passes it with that scheduler.

The pipeline's default scheduler is `UniPCMultistepScheduler` (a multistep predictor-corrector in flow mode, on
`flow_shift`-shifted sigmas): each of its updates mixes the model outputs of several steps, so a step's transition is
not one Gaussian of the step's own output and has no per-step log-prob for GRPO. The RL sampler therefore keeps the
shift and replaces the solver: sigmas from `FlowMatchEulerDiscreteScheduler(shift=flow_shift).set_timesteps(T)`
(diffusers' own call; `WanPipeline` accepts that scheduler as it is), one model output per step. Its ODE steps are
that scheduler's Euler `step`; with an Euler scheduler in the pipeline, `WanPipeline` computes the same latents bit for
bit (tests/test_wan_pipeline.py). UniPC's samples differ (another solver, not another rounding)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
# from its defining module: `diffusers`' (and `diffusers.schedulers`') TYPE_CHECKING imports name dummy classes first
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler


def euler_scheduler(scheduler_config: Mapping[str, Any]) -> FlowMatchEulerDiscreteScheduler:
    """The Euler scheduler of a checkpoint's scheduler config: its own config for a FlowMatchEulerDiscreteScheduler,
    or UniPC's flow shift and train timesteps for the published `UniPCMultistepScheduler` (flow prediction, flow
    sigmas)."""
    name = scheduler_config.get("_class_name")
    if name == "FlowMatchEulerDiscreteScheduler":
        if scheduler_config.get("use_dynamic_shifting"):
            raise ValueError("this Wan scheduler config uses dynamic shifting; Wan shifts its sigmas statically "
                             "(`shift`)")
        return FlowMatchEulerDiscreteScheduler.from_config(dict(scheduler_config))
    if name == "UniPCMultistepScheduler":
        if scheduler_config.get("prediction_type") != "flow_prediction" or not scheduler_config.get("use_flow_sigmas"):
            raise ValueError("this UniPCMultistepScheduler config is not in flow mode (prediction_type "
                             "'flow_prediction', use_flow_sigmas true), as Wan's checkpoints ship it")
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=scheduler_config.get("num_train_timesteps", 1000),
                                               shift=float(scheduler_config.get("flow_shift", 1.0)))
    raise ValueError(f"a Wan checkpoint's scheduler is UniPCMultistepScheduler (flow mode) or "
                     f"FlowMatchEulerDiscreteScheduler, got {name!r}")


def wan_schedule(scheduler_config: Mapping[str, Any], num_steps: int, image_seq_len: int,
                 device: torch.device | str | None = None, per_token: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sigmas [T+1] fp32, timesteps [T] fp32)` as `scheduler.set_timesteps(T, device=device)` sets them; with
    `per_token` (the TI2V-5B's `expand_timesteps`) the timesteps `[T, S]`, each step's `t` for every one of the
    `image_seq_len` tokens: WanPipeline's `(mask[0][0][:, ::2, ::2] * t).flatten()` with an all-ones mask."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = euler_scheduler(scheduler_config)
    scheduler.set_timesteps(num_steps, device=device)  # type: ignore[arg-type]  # diffusers' `device: str | device = None`
    # tensors once set_timesteps ran (the checker infers the attributes from __init__'s numpy arithmetic)
    sigmas, timesteps = scheduler.sigmas, cast(torch.Tensor, scheduler.timesteps)
    if per_token:
        timesteps = timesteps[:, None].expand(-1, image_seq_len).contiguous()
    return sigmas, timesteps
