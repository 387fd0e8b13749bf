"""GRPO group advantages against a float64 oracle written from flow-GRPO's published formula
(flow_grpo/stat_tracking.py `PerPromptStatTracker`): `(r − mean_group) / (std + 1e-4)` with numpy's population
std of the group, or of all rewards with `global_std`, then clipped to ±adv_clip_max (scripts/train_sd3.py).
A NaN reward marks a skipped sample: advantage 0, and no part in any mean or std. No oracle calls trueflow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trueflow.rl.advantages import group_advantages

N = 4


def _oracle(rewards: np.ndarray, n: int, clip_max: float, global_std: bool) -> np.ndarray:
    out = np.zeros_like(rewards)
    kept = rewards[~np.isnan(rewards)]
    for g in range(len(rewards) // n):
        idx = np.arange(g * n, (g + 1) * n)
        group = rewards[idx]
        ok = ~np.isnan(group)
        if not ok.any():
            continue
        std = np.std(kept) if global_std else np.std(group[ok])
        out[idx[ok]] = (group[ok] - group[ok].mean()) / (std + 1e-4)
    return np.clip(out, -clip_max, clip_max)


def _run(rewards: np.ndarray, clip_max: float = 5.0, global_std: bool = False) -> np.ndarray:
    got = group_advantages(torch.tensor(rewards, dtype=torch.float32), N, clip_max, global_std)
    assert got.shape == (len(rewards),) and got.dtype == torch.float32
    return got.double().numpy()


REWARDS = np.array([0.1, 0.4, 0.35, 0.9,    # group 0: a spread
                    2.0, 2.5, 1.0, 3.0,     # group 1: a larger spread (global and group std differ)
                    0.5, 0.5, 0.5, 0.5])    # group 2: equal rewards


@pytest.mark.parametrize("global_std", [False, True])
def test_advantages_match_float64(global_std: bool):
    np.testing.assert_allclose(_run(REWARDS, global_std=global_std), _oracle(REWARDS, N, 5.0, global_std),
                               rtol=1e-5, atol=1e-6)


def test_per_group_and_global_std_differ_here():
    # Guards the two tests above against inputs where the choice of std would not matter.
    assert np.abs(_oracle(REWARDS, N, 5.0, False) - _oracle(REWARDS, N, 5.0, True)).max() > 0.1


def test_equal_rewards_give_zero_advantage():
    assert (_run(np.full(2 * N, 0.7)) == 0).all()


def test_the_std_epsilon_is_flow_grpos_1e_4():
    """A spread of the order of the epsilon: the advantage's size is set by `std + 1e-4`."""
    rewards = np.array([0.0, 1e-4, 2e-4, 3e-4])
    np.testing.assert_allclose(_run(rewards), _oracle(rewards, N, 5.0, False), rtol=1e-3)


def test_advantages_are_clipped_both_ways():
    # one outlier: unclipped, its advantage would be +1.73 and the others -0.58
    rewards = np.array([0.0, 0.0, 0.0, 10.0])
    clip = 1.0
    got = _run(rewards, clip_max=clip)
    np.testing.assert_allclose(got, _oracle(rewards, N, clip, False), rtol=1e-5)
    assert got.max() == pytest.approx(clip)
    low = _run(-rewards, clip_max=clip)
    assert low.min() == pytest.approx(-clip)
    np.testing.assert_allclose(low, _oracle(-rewards, N, clip, False), rtol=1e-5)


def test_skipped_samples_get_zero_and_stay_out_of_every_statistic():
    rewards = REWARDS.copy()
    rewards[N:2 * N] = np.nan      # a group the reward skipped
    rewards[1] = np.nan            # and one sample of another group
    for global_std in (False, True):
        got = _run(rewards, global_std=global_std)
        assert np.isfinite(got).all()
        assert (got[N:2 * N] == 0).all() and got[1] == 0
        np.testing.assert_allclose(got, _oracle(rewards, N, 5.0, global_std), rtol=1e-5, atol=1e-6)


def test_shape_errors_name_the_expected_layout():
    with pytest.raises(ValueError, match=r"\[P\*4\]"):
        group_advantages(torch.zeros(6), N)
