"""PPO-clip and flow-GRPO's KL penalty against float64 oracles written from the published formulas.

PPO-clip (Schulman et al. 2017, Eq. 7, as a loss): `mean(max(−A·r, −A·clip(r, 1−ε, 1+ε)))`, `r = exp(logp − logp_old)`.
KL (flow-GRPO, scripts/train_sd3.py): `mean((μ − μ_ref)²) / (2·s²)` per sample, where s is the `std_dev_t` its
sampler returns — the SDE's diffusion coefficient `a·sqrt(σ/(1−σ))` (no `sqrt|dt|`), or CPS's transition std
`σ_next·sin(a·π/2)`. None of the oracles below calls trueflow.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trueflow.engine.samplers import cps_log_prob, sde_log_prob
from trueflow.rl.loss import kl_penalty, ppo_clip_loss

EPS_CLIP = 0.2


def _ppo_oracle(logp: np.ndarray, logp_old: np.ndarray, adv: np.ndarray, eps: float):
    """float64 loss, d loss / d logp, and clip fraction."""
    r = np.exp(logp - logp_old)
    unclipped, clipped = -adv * r, -adv * np.clip(r, 1 - eps, 1 + eps)
    loss = np.maximum(unclipped, clipped).mean()
    # The max picks the unclipped term (gradient −A·r/B) unless the clipped one is strictly larger, which
    # happens only where r is outside [1−ε, 1+ε] on the side the advantage pushes towards (gradient 0).
    grad = np.where(unclipped >= clipped, -adv * r, 0.0) / len(r)
    return loss, grad, float((np.abs(r - 1) > eps).mean())


# log-ratio far from 0 on both sides, with both signs of the advantage, and inside the trust region
LOG_RATIO = np.array([1.0, 1.0, -1.0, -1.0, 0.05, -0.05, 0.6, -0.7])
ADV = np.array([1.5, -1.5, 1.5, -1.5, 0.8, -0.8, -2.0, 2.0])


def test_ppo_clip_loss_gradient_and_stats_match_float64():
    old = np.linspace(-3.0, 1.0, len(LOG_RATIO))
    logp = torch.tensor(old + LOG_RATIO, dtype=torch.float32, requires_grad=True)
    loss, stats = ppo_clip_loss(logp, torch.tensor(old, dtype=torch.float32), torch.tensor(ADV, dtype=torch.float32),
                                EPS_CLIP)
    loss.backward()
    want_loss, want_grad, want_clip = _ppo_oracle(logp.detach().double().numpy(), old, ADV, EPS_CLIP)
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(logp.grad.double().numpy(), want_grad, rtol=1e-6, atol=1e-9)
    r = np.exp(LOG_RATIO)
    assert stats.clip_frac == pytest.approx(want_clip)
    assert stats.ratio_mean == pytest.approx(r.mean(), rel=1e-6)
    assert stats.ratio_max_abs_dev_from_1 == pytest.approx(np.abs(r - 1).max(), rel=1e-6)


@pytest.mark.parametrize("log_ratio, adv, clipped", [
    (1.0, 1.0, True),     # r = e > 1+ε pushing up: clipped, no gradient
    (-1.0, -1.0, True),   # r = 1/e < 1−ε pushing down: clipped, no gradient
    (1.0, -1.0, False),   # r > 1+ε but the advantage pulls it back: the unclipped branch
    (-1.0, 1.0, False),   # r < 1−ε, advantage pushes it back up: the unclipped branch
    (0.1, 1.0, False),    # inside the trust region
])
def test_ppo_clip_gradient_is_zero_exactly_through_the_clipped_branch(log_ratio: float, adv: float, clipped: bool):
    logp = torch.tensor([log_ratio], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, torch.zeros(1), torch.tensor([adv]), EPS_CLIP)
    loss.backward()
    if clipped:
        assert logp.grad.item() == 0.0
        assert loss.item() == pytest.approx(-adv * (1 + EPS_CLIP if log_ratio > 0 else 1 - EPS_CLIP), rel=1e-6)
    else:
        assert logp.grad.item() == pytest.approx(-adv * math.exp(log_ratio), rel=1e-6)


def test_ppo_clip_on_policy_is_minus_the_mean_advantage_with_its_gradient():
    adv = torch.tensor(ADV, dtype=torch.float32)
    logp = torch.full((len(ADV),), -2.5, requires_grad=True)
    loss, stats = ppo_clip_loss(logp, logp.detach().clone(), adv, EPS_CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(-ADV.mean(), abs=1e-7)
    np.testing.assert_allclose(logp.grad.numpy(), -ADV / len(ADV), rtol=1e-6)
    assert (stats.ratio_mean, stats.ratio_max_abs_dev_from_1, stats.clip_frac) == (1.0, 0.0, 0.0)


# ------------------------------------------------------------------------------------------------------- KL
B, SEQ, CH = 4, 16, 8
NOISE_LEVEL = 0.7


def _means(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mean = rng.standard_normal((B, SEQ, CH))
    return mean, mean + 0.05 * rng.standard_normal((B, SEQ, CH))


def _kl_oracle(mean: np.ndarray, ref: np.ndarray, s: np.ndarray) -> np.ndarray:
    return ((mean - ref) ** 2).mean(axis=(1, 2)) / (2 * s**2)


def _sigmas(last_step: bool = False) -> tuple[np.ndarray, np.ndarray]:
    sigma = np.array([0.9, 0.6, 0.35, 0.1])
    sigma_next = sigma - np.array([0.1, 0.2, 0.05, 0.1 if last_step else 0.04])
    return sigma, sigma_next


def _stds(sampler: str, sigma: np.ndarray, sigma_next: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's `std` (as the trainer gets it) and `dt`, from trueflow's samplers on random inputs."""
    x, v = torch.randn(B, SEQ, CH), torch.randn(B, SEQ, CH)
    s, s_next = torch.tensor(sigma, dtype=torch.float32), torch.tensor(sigma_next, dtype=torch.float32)
    if sampler == "sde":
        _, _, std = sde_log_prob(x, x, v, s, s_next, 0.95, NOISE_LEVEL)
    else:
        _, _, std = cps_log_prob(x, x, v, s, s_next, NOISE_LEVEL)
    return std, s_next - s


def test_cps_kl_is_mean_sq_over_twice_the_cps_transition_variance():
    sigma, sigma_next = _sigmas()
    std, dt = _stds("cps", sigma, sigma_next)
    mean, ref = _means(0)
    got = kl_penalty(torch.tensor(mean, dtype=torch.float32), torch.tensor(ref, dtype=torch.float32), std, dt, "cps")
    want = _kl_oracle(mean, ref, sigma_next * math.sin(NOISE_LEVEL * math.pi / 2))
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5)


def test_sde_kl_divides_by_flow_grpos_diffusion_coefficient_not_the_transition_std():
    sigma, sigma_next = _sigmas()
    std, dt = _stds("sde", sigma, sigma_next)
    mean, ref = _means(1)
    got = kl_penalty(torch.tensor(mean, dtype=torch.float32), torch.tensor(ref, dtype=torch.float32), std, dt, "sde")
    want = _kl_oracle(mean, ref, NOISE_LEVEL * np.sqrt(sigma / (1 - sigma)))
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5)


def test_kl_excludes_the_last_step_where_cps_is_deterministic():
    """σ_next = 0: CPS's std is 0, the transition is a point and has no Gaussian KL. That row is 0 (excluded),
    the others are unchanged, and the backward pass stays finite."""
    sigma, sigma_next = _sigmas(last_step=True)
    assert sigma_next[-1] == 0.0
    std, dt = _stds("cps", sigma, sigma_next)
    assert std[-1].item() == 0.0
    mean_np, ref_np = _means(2)
    mean = torch.tensor(mean_np, dtype=torch.float32, requires_grad=True)
    got = kl_penalty(mean, torch.tensor(ref_np, dtype=torch.float32), std, dt, "cps")
    want = _kl_oracle(mean_np[:-1], ref_np[:-1], sigma_next[:-1] * math.sin(NOISE_LEVEL * math.pi / 2))
    np.testing.assert_allclose(got[:-1].detach().double().numpy(), want, rtol=1e-5)
    assert got[-1].item() == 0.0
    got.mean().backward()
    assert torch.isfinite(mean.grad).all() and (mean.grad[-1] == 0).all() and (mean.grad[:-1] != 0).any()


def test_kl_refuses_an_unknown_sampler():
    with pytest.raises(ValueError, match="sampler"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), -torch.ones(1), "ode")
