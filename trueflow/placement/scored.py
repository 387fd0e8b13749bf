"""An engine whose every rollout comes back scored, wherever it runs."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..engine.interface import EngineWrapper, RolloutEngine, RolloutRequest, StopCheck
from ..rewards.base import Reward, score_samples

if TYPE_CHECKING:
    from ..engine.trajectory import Rollout


class ScoredEngine(EngineWrapper):
    """`rollout.rewards` (float32 [P·n], NaN where the reward dropped a prompt's group) and `rollout.dropped`, by
    `reward` (a `rewards.base` reward) with `on_error`, on `frames` frames of a video (`rewards.base.score_samples`);
    the rollout's `times` gain `reward` (seconds)."""

    def __init__(self, engine: RolloutEngine, reward: Reward, on_error: str = "raise", frames: int = 1):
        super().__init__(engine)
        self.reward, self.on_error, self.frames = reward, on_error, frames

    def rollout(self, request: RolloutRequest, should_stop: StopCheck | None = None) -> Rollout:
        if not request.decode:
            raise ValueError("a scored rollout needs its images: decode=True")
        rollout = self.engine.rollout(request, should_stop)
        assert rollout.images is not None  # decode=True
        t0 = time.perf_counter()
        rollout.rewards, rollout.dropped = score_samples(self.reward, rollout.images, request.sample_prompts(),
                                                         self.on_error, self.frames)
        rollout.times["reward"] = time.perf_counter() - t0
        return rollout

    def health(self) -> dict:
        return {**self.engine.health(), "reward": getattr(self.reward, "name", repr(self.reward))}
