"""Engine placement: every implementation of the engine interface (`engine.interface.RolloutEngine`) and the one
factory that builds them, `build_engine(spec, placement)`.

A placement is a name in `PLACEMENTS` mapped to a builder imported when first used (verl's rollout registry is the
model), so asking for an in-process engine never imports Ray, httpx or multiprocessing machinery:

    local              engine.Engine in this process                          placement.local
    process            the engine in a process of its own (tp = 1)            placement.process.EngineClient
    tp                 N tensor-parallel processes (tp > 1)                   placement.process.EngineClient
    http               a `trueflow serve` server on this machine              placement.http.HttpEngine
    ray_colocated      this trainer rank's Ray engine actor, on its device    placement.ray
    ray_disaggregated  an engine actor on devices of its own                  placement.ray

`train`, `generate` and `serve` each call `build_engine` and nothing else. A reward given with the placement scores
every rollout where `Placement.reward_at` says (`placement.scored.ScoredEngine` in the caller's process).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .spec import EngineSpec, Placement, RewardSpec

if TYPE_CHECKING:
    import torch

    from ..engine.interface import RolloutEngine

__all__ = ["PLACEMENTS", "EngineSpec", "Placement", "RewardSpec", "build_engine", "placement_kind"]

# name -> "module:attribute" of a builder (spec, placement) -> RolloutEngine
PLACEMENTS: dict[str, str] = {
    "local": "trueflow.placement.local:local_engine",
    "process": "trueflow.placement.process:EngineClient.from_placement",
    "tp": "trueflow.placement.process:EngineClient.from_placement",
    "http": "trueflow.placement.http:HttpEngine.from_placement",
    "ray_colocated": "trueflow.placement.ray:ray_engine",
    "ray_disaggregated": "trueflow.placement.ray:ray_engine",
}


def _builder(kind: str) -> Callable[..., RolloutEngine]:
    if kind not in PLACEMENTS:
        raise ValueError(f"unknown engine placement {kind!r}; choose one of {', '.join(PLACEMENTS)}")
    module, _, attr = PLACEMENTS[kind].partition(":")
    obj: Any = importlib.import_module(module)  # then the builder it names, found at run time
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def placement_kind(placement: Placement) -> str:
    """The registry name of a placement: `process` with tp > 1 is `tp`."""
    return "tp" if placement.kind == "process" and placement.tp > 1 else placement.kind


def build_engine(spec: EngineSpec, placement: Placement | None = None,
                 base: Sequence[Mapping[str, torch.Tensor]] | None = None) -> RolloutEngine:
    """The engine `spec` describes, where `placement` puts it (default: in this process), scored by the
    placement's reward where it says (in the caller's process here; in the engine process or a Ray reward actor by
    those placements). `base`: per expert, the caller's frozen base tensors, which an engine in this process reads
    instead of loading its own copy (`train.shared_base`); another process cannot read them."""
    placement = placement or Placement()
    kind = placement_kind(placement)
    if kind == "tp" and placement.tp < 2:
        raise ValueError("the tp placement runs 2 or more tensor-parallel processes: give tp > 1")
    if base is not None and kind != "local":
        raise ValueError(f"an engine of the {kind} placement runs in another process: it cannot read this "
                         "process's base weights (share them with the local placement only)")
    reward = None
    if placement.reward is not None and placement.reward_at == "caller":
        from ..rewards.base import build_reward

        r = placement.reward
        reward = build_reward(r.spec, r.model, r.device, url=r.url)  # a bad spec fails before an engine starts
    engine = _builder(kind)(spec, placement) if base is None else _builder(kind)(spec, placement, base)
    if reward is None:
        return engine
    from .scored import ScoredEngine

    assert placement.reward is not None  # `reward` was built from it
    return ScoredEngine(engine, reward, placement.reward.on_error, placement.reward.frames)
