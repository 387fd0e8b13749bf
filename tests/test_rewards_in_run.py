"""A training run whose reward is a weighted sum of two model rewards (the aesthetic predictor and CLIPScore on one
tiny CLIP folder), given as a user gives it: `--reward aesthetic:1,clip_score:0.01 --reward-model DIR`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_rewards_clip import published_aesthetic

from trueflow.rewards import WeightedSum, build_reward
from trueflow.rewards.tiny_clip import init_tiny_aesthetic
from trueflow.train.config import TrainConfig
from trueflow.train.metrics import read_metrics
from trueflow.train.run import run_training


def test_a_run_scores_with_the_weighted_sum(tiny_checkpoint, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = init_tiny_aesthetic(tmp_path / "clip", seed=1)
    calls: list[tuple[torch.Tensor, list[str], torch.Tensor]] = []
    original = WeightedSum.__call__

    def recording(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = original(self, images, prompts)
        calls.append((images.clone(), list(prompts), out.clone()))
        return out

    monkeypatch.setattr(WeightedSum, "__call__", recording)
    run_training(TrainConfig(
        output_dir=str(tmp_path / "run"), checkpoint=str(tiny_checkpoint), num_rollouts=1, steps=3, num_sde_steps=1,
        rollout_batch_size=2, n_samples_per_prompt=4, rollout_microgroup_size=4, micro_batch_size_sample=4,
        reward="aesthetic:1,clip_score:0.01", reward_model=str(clip)))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")

    assert len(calls) == 1 and len(rows) == 1
    images, prompts, scores = calls[0]
    assert images.shape[0] == 8 and len(set(prompts)) == 2
    # the run's rewards are the two rewards' weighted sum on its own images, the aesthetic one as published
    clip_scores = build_reward("clip_score", model_path=str(clip))(images, prompts).double()
    expected = published_aesthetic(clip, images) + 0.01 * clip_scores
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-5)
    assert rows[0]["reward_mean"] == pytest.approx(scores.mean().item(), rel=1e-6)
    assert rows[0]["reward_std"] > 0 and np.isfinite(rows[0]["reward_std"])
