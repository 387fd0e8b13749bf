"""The one engine interface the trainer, the server and the scripts use, whichever process runs the engine.

    rollout(request, should_stop) -> Rollout    update_weights(state, lora_scale, merge_mode) -> checksum
    checksum() -> str                           health() -> dict          shutdown()

Implementations (built by `trueflow.placement.build_engine`): `engine.Engine` (in this process), and in
`trueflow.placement` the engine in its own process or over N tensor-parallel processes, a `trueflow serve` server,
and Ray engine actors (colocated or disaggregated). `EngineWrapper` puts something in front of any of them
(`placement.scored.ScoredEngine`: a reward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .request import RolloutRequest

if TYPE_CHECKING:
    import torch

    from .trajectory import Rollout

__all__ = ["EngineDied", "EngineWrapper", "RolloutCancelled", "RolloutEngine", "RolloutRequest", "StopCheck"]

StopCheck = Callable[[], bool]  # asked between denoising steps; True stops the rollout (RolloutCancelled)


class RolloutCancelled(Exception):
    """A rollout stopped between denoising steps because its `should_stop` said so; nothing is returned."""


class EngineDied(RuntimeError):
    """The engine is gone: its process or one of its tensor-parallel ranks died, or its server stopped answering.
    The message is one line naming what died (its traceback, if any, went to the log); every later call fails
    alike. A server answers it 503, a training run stops on it and resumes from its last checkpoint."""


class RolloutEngine(Protocol):
    def rollout(self, request: RolloutRequest, should_stop: StopCheck | None = None) -> Rollout:
        """The request's samples, recorded (`Rollout`); tensors may live on the engine's device. `should_stop` is
        asked before every denoising step (wherever the engine runs), and a true answer raises RolloutCancelled."""

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        """Install `state`: a PEFT-format LoRA with `lora_scale`, or (None) every transformer weight under diffusers'
        names. All or nothing: a bad update raises ValueError and changes nothing. Returns `checksum()` after it
        (or, for full weights, the weights checksum)."""

    def checksum(self) -> str:
        """The checksum of the installed LoRA, read back from the engine's layers (`sync.checksum`)."""

    def health(self) -> dict:
        """What the engine runs (checkpoint, family, patch group, dtype, device) and whether it is well."""

    def shutdown(self) -> None:
        """Release the engine (its process, its connection); a second call does nothing."""


class EngineWrapper:
    """An engine in front of another: every call goes to `engine` unless a subclass says otherwise."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def rollout(self, request: RolloutRequest, should_stop: StopCheck | None = None) -> Rollout:
        return self.engine.rollout(request, should_stop)

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        return self.engine.update_weights(state, lora_scale, merge_mode)

    def checksum(self) -> str:
        return self.engine.checksum()

    def health(self) -> dict:
        return self.engine.health()

    def shutdown(self) -> None:
        self.engine.shutdown()
