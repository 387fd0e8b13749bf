"""GRPO-Guard's RatioNorm and step reweighting against float64 oracles from the paper's formula (arXiv 2510.22319,
Eq. 8 and Eq. 12 as flow-GRPO's GRPO-Guard code implements them) and from the Gaussian algebra it rests on:
for `x' = μ_old + s·ε`, `s·(log r + mean(Δμ²)/(2s²)) = mean(ε·Δμ)`. No oracle calls trueflow.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trueflow.rl.grpo_guard import normalized_ratio, step_weight
from trueflow.rl.loss import clipped_surrogate

B, D = 4, 64
S = np.array([0.3, 0.12, 0.05, 0.2])  # a different transition std per pair


def _gaussian_log_prob(x: np.ndarray, mu: np.ndarray, s: np.ndarray) -> np.ndarray:
    """flow-GRPO's SDE log-prob: the per-element mean of log N(x; μ, s²)."""
    s = s[:, None]
    return (-((x - mu) ** 2) / (2 * s**2) - np.log(s) - 0.5 * math.log(2 * math.pi)).mean(axis=1)


def _case(seed: int, shift: float = 0.02):
    rng = np.random.default_rng(seed)
    mu_old = rng.standard_normal((B, D))
    d_mu = shift * rng.standard_normal((B, D))
    eps = rng.standard_normal((B, D))
    x = mu_old + S[:, None] * eps
    return mu_old, d_mu, eps, _gaussian_log_prob(x, mu_old + d_mu, S), _gaussian_log_prob(x, mu_old, S)


def _t(a: np.ndarray, **kw) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float32, **kw)


def test_ratio_norm_is_the_published_formula():
    mu_old, d_mu, _, logp, logp_old = _case(0)
    logp = logp + np.array([0.3, -0.2, 0.1, 0.0])  # any log-probs: the formula, not only the identity
    want = np.exp(S * (logp - logp_old + (d_mu**2).mean(axis=1) / (2 * S**2)))
    got = normalized_ratio(_t(logp), _t(logp_old), _t(mu_old + d_mu), _t(mu_old), _t(S))
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5)


def test_ratio_norm_centres_the_log_ratio_on_mean_eps_dmu():
    """The identity the method rests on: log r̂ = mean(ε·Δμ), whatever the step's s; plain log r is not."""
    mu_old, d_mu, eps, logp, logp_old = _case(1)
    got = normalized_ratio(_t(logp), _t(logp_old), _t(mu_old + d_mu), _t(mu_old), _t(S))
    np.testing.assert_allclose(torch.log(got).double().numpy(), (eps * d_mu).mean(axis=1), rtol=1e-3, atol=1e-6)
    # the unnormalised ratio carries the −mean(Δμ²)/(2s²) bias and the 1/s scale
    np.testing.assert_allclose(logp - logp_old, (eps * d_mu).mean(axis=1) / S - (d_mu**2).mean(axis=1) / (2 * S**2))


def test_ratio_norm_is_one_on_policy():
    mu_old, _, _, _, logp_old = _case(2)
    got = normalized_ratio(_t(logp_old), _t(logp_old), _t(mu_old), _t(mu_old), _t(S))
    assert torch.equal(got, torch.ones(B))


def test_ratio_norm_gradient_flows_through_the_bias_term():
    """With the log-prob a function of μ_θ, d r̂/dμ_θ = r̂·ε/D (from the identity); dropping the bias's gradient
    would leave the Gaussian log-prob's own gradient, which is not that."""
    mu_old, d_mu, eps, _, logp_old = _case(3)
    mu = _t(mu_old + d_mu, requires_grad=True)
    x = _t(mu_old + S[:, None] * eps)
    s = _t(S)[:, None]
    logp = (-((x - mu) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).mean(dim=1)
    ratio = normalized_ratio(logp, _t(logp_old), mu, _t(mu_old), _t(S))
    ratio.sum().backward()
    want = np.exp((eps * d_mu).mean(axis=1))[:, None] * eps / D
    np.testing.assert_allclose(mu.grad.double().numpy(), want, rtol=2e-3, atol=1e-6)


def test_step_weight_reweights_each_pairs_clipped_surrogate_by_one_over_dt():
    dt = np.array([-0.1, -0.05, -0.2, -0.025])
    np.testing.assert_allclose(step_weight(_t(dt)).double().numpy(), 1 / np.abs(dt), rtol=1e-6)
    ratio, adv, eps = np.array([1.5, 0.5, 1.1, 0.9]), np.array([1.0, -1.0, -0.5, 2.0]), 0.2
    loss, _ = clipped_surrogate(_t(ratio), _t(adv), eps, weight=step_weight(_t(dt)))
    per_pair = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps, 1 + eps))
    assert loss.item() == pytest.approx((per_pair / np.abs(dt)).mean(), rel=1e-6)
