"""The one engine interface the trainer, the server and the scripts use, whichever process runs the engine.

    rollout(request) -> Rollout          update_weights(state, lora_scale, merge_mode) -> checksum
    checksum() -> str                    health() -> dict          shutdown()

Implementations: `Engine` (in this process), `sync.engine_process.EngineClient` (its own process, weights by shared
memory / CUDA IPC), `engine.http_engine.HttpEngine` (a `trueflow serve` server). `ScoredEngine` puts a reward in
front of any of them, so a rollout arrives scored wherever the reward runs (in the trainer, or in an engine process
that scores its own images before they leave it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .sampling_params import SamplingParams
    from .trajectory import Rollout


@dataclass(frozen=True)
class RolloutRequest:
    """`n_per_prompt` samples of each prompt. `first_prompt` is the global index of `prompts[0]` in the rollout that a
    data-parallel run splits over its engines: every random stream of a sample (its noise, its microgroup's SDE
    window) follows the sample's global prompt index, so a prompt's samples are the same whichever engine draws
    them. The rollout's own indices (`prompt_index`, `sample_indices`, image order) stay local to the request."""

    prompts: list[str]
    n_per_prompt: int
    params: SamplingParams
    seed: int
    first_prompt: int = 0
    decode: bool = True
    record_snapshot: bool = False

    def __post_init__(self) -> None:
        if self.first_prompt < 0:
            raise ValueError(f"first_prompt must be >= 0, got {self.first_prompt}")

    def sample_prompts(self) -> list[str]:
        """Each sample's prompt, prompt-major (the order of the rollout's images)."""
        return [p for p in self.prompts for _ in range(self.n_per_prompt)]


class RolloutEngine(Protocol):
    def rollout(self, request: RolloutRequest) -> Rollout:
        """The request's samples, recorded (`Rollout`); tensors may live on the engine's device."""

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

    def rollout(self, request: RolloutRequest) -> Rollout:
        return self.engine.rollout(request)

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        return self.engine.update_weights(state, lora_scale, merge_mode)

    def checksum(self) -> str:
        return self.engine.checksum()

    def health(self) -> dict:
        return self.engine.health()

    def shutdown(self) -> None:
        self.engine.shutdown()


class ScoredEngine(EngineWrapper):
    """An engine whose every rollout comes back scored: `rollout.rewards` (float32 [P·n], NaN where the reward
    dropped a prompt's group) and `rollout.dropped`, by `reward` (a `rewards.base` reward) with `on_error`. The
    rollout's `times` gain `reward` (seconds). Videos (`[P·n, F, H, W, 3]`) are scored by the image reward on
    `frames` evenly spread frames (first and last included), averaged; a prompt dropped on any frame is dropped."""

    def __init__(self, engine: RolloutEngine, reward, on_error: str = "raise", frames: int = 1):
        super().__init__(engine)
        self.reward, self.on_error, self.frames = reward, on_error, frames

    def rollout(self, request: RolloutRequest) -> Rollout:
        from ..rewards.base import score
        from ..video import frame_indices

        if not request.decode:
            raise ValueError("a scored rollout needs its images: decode=True")
        rollout = self.engine.rollout(request)
        t0 = time.perf_counter()
        images, prompts = rollout.images, request.sample_prompts()
        if images.ndim == 4:
            rollout.rewards, rollout.dropped = score(self.reward, images, prompts, on_error=self.on_error)
        else:
            per_frame = [score(self.reward, images[:, f].contiguous(), prompts, on_error=self.on_error)
                         for f in frame_indices(images.shape[1], self.frames)]
            # A dropped group is NaN in its frames' scores, so the mean keeps it NaN (out of the statistics).
            rollout.rewards = torch.stack([r for r, _ in per_frame]).mean(0)
            rollout.dropped = sorted({i for _, dropped in per_frame for i in dropped})
        rollout.times["reward"] = time.perf_counter() - t0
        return rollout

    def health(self) -> dict:
        return {**self.engine.health(), "reward": getattr(self.reward, "name", repr(self.reward))}
