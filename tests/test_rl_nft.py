"""DiffusionNFT's loss against float64 oracles written from the paper (arXiv 2509.16117): Eq. 5 with the implicit
positive/negative policies of Theorem 3.2, its optimum (Eq. 6, solved here by hand for one point), the optimality
reward and the adaptive weighting of Sec. 3.3, and the official code's 1/β. No oracle calls trueflow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trueflow.rl.nft import forward_noise, nft_loss, optimality

B, D = 4, 32
BETA = 0.1


def _case(seed: int):
    rng = np.random.default_rng(seed)
    x0, noise = rng.standard_normal((B, D)), rng.standard_normal((B, D))
    v_old = (noise - x0) + 0.3 * rng.standard_normal((B, D))
    v = v_old + 0.1 * rng.standard_normal((B, D))
    t = np.array([0.9, 0.5, 0.25, 0.05])
    r = np.array([1.0, 0.0, 0.7, 0.25])
    return x0, noise, v_old, v, t, r


def _t(a: np.ndarray, **kw) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float32, **kw)


def _policies(v_old: np.ndarray, v: np.ndarray, beta: float):
    return (1 - beta) * v_old + beta * v, (1 + beta) * v_old - beta * v


def _oracle(x0, noise, v_old, v, t, r, beta, adaptive: bool):
    """float64 loss per sample and its gradient in v."""
    v_pos, v_neg = _policies(v_old, v, beta)
    tt = t[:, None]
    if adaptive:
        x_t = (1 - tt) * x0 + tt * noise
        e_pos, e_neg = x_t - tt * v_pos - x0, x_t - tt * v_neg - x0
        w_pos = np.maximum(np.abs(e_pos).mean(axis=1), 1e-5)[:, None]
        w_neg = np.maximum(np.abs(e_neg).mean(axis=1), 1e-5)[:, None]
        loss = (r * (e_pos**2 / w_pos).mean(axis=1) + (1 - r) * (e_neg**2 / w_neg).mean(axis=1)) / beta
        # d e_pos/dv = −t·β, d e_neg/dv = +t·β; the weights are stop-gradient
        grad = (r[:, None] * 2 * e_pos * (-tt) / w_pos + (1 - r[:, None]) * 2 * e_neg * tt / w_neg) / D
    else:
        u = noise - x0
        loss = (r * ((v_pos - u) ** 2).mean(axis=1) + (1 - r) * ((v_neg - u) ** 2).mean(axis=1)) / beta
        grad = (r[:, None] * 2 * (v_pos - u) - (1 - r[:, None]) * 2 * (v_neg - u)) / D
    return loss, grad


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("beta", [BETA, 1.0])
def test_nft_loss_and_gradient_match_float64(adaptive: bool, beta: float):
    x0, noise, v_old, v, t, r = _case(0)
    vt = _t(v, requires_grad=True)
    got = nft_loss(vt, _t(v_old), _t(x0), _t(noise), _t(t), _t(r), beta, adaptive_weight=adaptive)
    got.sum().backward()
    want, want_grad = _oracle(x0, noise, v_old, v, t, r, beta, adaptive)
    np.testing.assert_allclose(got.detach().double().numpy(), want, rtol=1e-4)
    np.testing.assert_allclose(vt.grad.double().numpy(), want_grad, rtol=1e-3, atol=1e-6)


def test_the_gradient_vanishes_at_eq6s_optimum():
    """Minimising Eq. 5 at one point by hand: v* = v_old + (2r − 1)(v − v_old)/β with v the target velocity,
    Eq. 6's v_old + (2/β)·Δ for a point mass. r = 1 steps towards the target, r = 0 away from it."""
    x0, noise, v_old, _, t, r = _case(1)
    u = noise - x0
    v_star = _t(v_old + (2 * r[:, None] - 1) * (u - v_old) / BETA, requires_grad=True)
    nft_loss(v_star, _t(v_old), _t(x0), _t(noise), _t(t), _t(r), BETA, adaptive_weight=False).sum().backward()
    assert v_star.grad.abs().max().item() < 1e-5
    # and not at v_old: there the loss pushes v towards the target for r > 1/2 and away for r < 1/2
    v0 = _t(v_old, requires_grad=True)
    nft_loss(v0, _t(v_old), _t(x0), _t(noise), _t(t), _t(r), BETA, adaptive_weight=False).sum().backward()
    step = -v0.grad.double().numpy()
    towards = (step * (u - v_old)).sum(axis=1)
    assert towards[0] > 0 and towards[1] < 0


def test_optimality_maps_advantages_into_zero_one():
    adv = np.array([-7.0, -5.0, -2.5, 0.0, 1.0, 5.0, 9.0])
    got = optimality(_t(adv), 5.0).double().numpy()
    np.testing.assert_allclose(got, 0.5 + 0.5 * np.clip(adv / 5.0, -1, 1), rtol=1e-7)
    assert got.min() == 0.0 and got.max() == 1.0


def test_forward_noise_is_rectified_flow():
    x0, noise, *_ = _case(2)
    t = np.array([1.0, 0.5, 0.2, 0.0])
    got = forward_noise(_t(x0), _t(noise), _t(t)).double().numpy()
    np.testing.assert_allclose(got, (1 - t[:, None]) * x0 + t[:, None] * noise, rtol=1e-6, atol=1e-7)
