"""Classifier-free guidance as the model family declares it (`models.spec.Guidance`), run by one function for the
rollout engine and the trainer, so both sides run the same forwards on the same batch composition.

A family's `Guidance` says:
- `formula`: what combines the branches (`models.cfg.plain_cfg`, `models.cfg.rescaled_cfg`: Qwen-Image's norm
  rescale); it runs in the model output's dtype with a python-float scale, as the pipelines do;
- `branches`: "separate" (positive forward, then negative), "batched" (one forward of the rows `[negative × B,
  positive × B]`, chunked back: SD3's `torch.cat([latents] * 2)`; the batched GEMMs round otherwise than two
  forwards do, so both sides must run the same one), or "none" (the family takes no CFG: `cfg_scale > 1` refused);
- `distilled_input`: a model input taking a guidance-distilled scale (FLUX.1-dev's `guidance`), recorded as a
  conditioning entry (an fp32 scalar per sample, `[B]` collated) of each branch, so the trainer, the snapshot and
  its replay pass exactly what the engine passed;
- `per_expert_scale`: every expert after the first takes `cfg_scale_2` (WanPipeline's `guidance_scale_2`,
  defaulting to the first scale). Which expert ran a step is recorded with the trajectory, never re-derived.
- `negative_prompt`: the negative prompt of a request that names none (`negative_prompt`); None: the family's
  pipeline has none by default and runs no CFG without one, so a CFG scale > 1 needs the request to name one.
A setting the family cannot take is refused in one line (`check_guidance`, `check_negative_prompt`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from ..collate import Cond, collate_cond, sample_cond
from ..models.spec import Guidance


class BranchForward(Protocol):
    def __call__(self, hidden_states: torch.Tensor, timestep: torch.Tensor, cond: Cond) -> torch.Tensor:
        """The model's output for a batch of latents, timesteps and one conditioning (the engine's model or the
        train side's diffusers call, with the step's expert and the microgroup's static inputs bound)."""


@dataclass
class Guided:
    output: torch.Tensor  # what the sampler steps with (before the family's `model_output`)
    positive: torch.Tensor  # the positive branch's model output
    negative: torch.Tensor | None  # the negative branch's; None without CFG


def guide(guidance: Guidance, forward: BranchForward, hidden_states: torch.Tensor, timestep: torch.Tensor,
          positive: Cond, negative: Cond | None, scale: float, streams: Mapping[str, str]) -> Guided:
    """One step's guided model output. `negative` None: the positive branch alone (CFG off)."""
    if negative is None:
        out = forward(hidden_states, timestep, positive)
        return Guided(out, out, None)
    if guidance.formula is None:
        raise ValueError("this family takes no classifier-free guidance, but a negative branch was given")
    if guidance.branches == "batched":
        rows = hidden_states.shape[0]
        both = forward(torch.cat([hidden_states, hidden_states]), torch.cat([timestep, timestep]),
                       batched_cond(negative, positive, rows, streams))
        neg_out, pos_out = both.chunk(2)
    else:
        pos_out = forward(hidden_states, timestep, positive)
        neg_out = forward(hidden_states, timestep, negative)
    return Guided(guidance.formula(pos_out, neg_out, scale), pos_out, neg_out)


def batched_cond(negative: Cond, positive: Cond, rows: int, streams: Mapping[str, str]) -> Cond:
    """The conditioning of a batched CFG forward: the negative branch's `rows` samples, then the positive's,
    collated as one batch (`collate.collate_cond`: streams padded batch-locally, an all-true mask None). Built from
    each sample's own entries on both sides, so a train micro-batch equal to a microgroup batches as the engine."""
    return collate_cond([sample_cond(negative, i, streams) for i in range(rows)]
                        + [sample_cond(positive, i, streams) for i in range(rows)], streams)


def expert_scale(k: int, cfg_scale: float, cfg_scale_2: float | None) -> float:
    """The CFG scale of expert `k`: `cfg_scale` for the first, `cfg_scale_2` (default `cfg_scale`) for the others."""
    return cfg_scale_2 if k > 0 and cfg_scale_2 is not None else cfg_scale


def distilled_entry(guidance: Guidance, scale: float | None, device: torch.device | str) -> Cond:
    """The distilled-guidance input of one sample (an fp32 scalar; stacked, FluxPipeline's `full([1], g,
    fp32).expand(B)` values), at `scale` or the family's default; {} for a family without that input."""
    if guidance.distilled_input is None:
        return {}
    value = guidance.distilled_default if scale is None else scale
    assert value is not None  # a distilled input has its default (`Guidance.__post_init__`)
    return {guidance.distilled_input: torch.full((), value, dtype=torch.float32, device=device)}


def negative_prompt(guidance: Guidance, given: str | None) -> str | None:
    """The negative prompt a request's CFG branch runs with: the one it names, else the family's (None: none)."""
    return guidance.negative_prompt if given is None else given


def check_negative_prompt(family: str, guidance: Guidance, cfg_scale: float, given: str | None) -> None:
    """Refuse, in one line naming both fixes, CFG without a negative prompt on a family whose pipeline runs none
    by default (FluxPipeline: `true_cfg_scale > 1` does nothing without `negative_prompt`)."""
    if cfg_scale > 1 and guidance.takes_cfg and negative_prompt(guidance, given) is None:
        distilled = (f"; its distilled guidance (--distilled-guidance-scale, default {guidance.distilled_default}) "
                     f"guides without it" if guidance.distilled_input else "")
        raise ValueError(f"{family} runs classifier-free guidance only with a negative prompt (its pipeline's "
                         f"default is none): pass negative_prompt (--negative-prompt TEXT), or set cfg_scale "
                         f"(--cfg-scale) to 1, got {cfg_scale}{distilled}")


def check_guidance(family: str, guidance: Guidance, cfg_scale: float, cfg_scale_2: float | None,
                   distilled_scale: float | None, experts: int | None = None) -> None:
    """Refuse, in one line naming the fix, a guidance setting `family` cannot take. `experts`: how many the
    checkpoint has (None: not known yet; the engine checks again)."""
    if cfg_scale > 1 and not guidance.takes_cfg:
        raise ValueError(f"{family} takes no classifier-free guidance (its engine runs the pipeline's unguided "
                         f"pass): set cfg_scale (--cfg-scale) to 1, got {cfg_scale}")
    if cfg_scale_2 is not None:
        if not guidance.per_expert_scale or (experts is not None and experts < 2):
            why = "takes no per-expert scale" if not guidance.per_expert_scale else "has one expert here"
            raise ValueError(f"cfg_scale_2 (--cfg-scale-2) is a second expert's CFG scale, and {family} {why}: "
                             f"leave it unset")
        if cfg_scale <= 1:
            raise ValueError(f"cfg_scale_2 (--cfg-scale-2) {cfg_scale_2} needs cfg_scale (--cfg-scale) > 1: CFG runs "
                             f"only when the first scale is above 1, as the pipeline's")
    if distilled_scale is not None and guidance.distilled_input is None:
        raise ValueError(f"{family} has no distilled guidance input: leave distilled_guidance_scale "
                         f"(--distilled-guidance-scale) unset, got {distilled_scale}")
