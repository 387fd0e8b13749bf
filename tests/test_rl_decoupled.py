"""The decoupled PPO objective and the truncated importance weight of `--async-rollouts` against float64 oracles
written from the equations (none calls trueflow):

    L = −mean( w · min(r·A, clip(r, 1−ε, 1+ε)·A) ),  r = π_θ/π_prox,  w = min(ρ̄, π_prox/μ) (no gradient)

(Hilton et al. 2021, arXiv 2110.00641; AReaL, Fu et al. 2025, arXiv 2505.24298; the truncation is IMPALA's V-trace
ρ_t = min(ρ̄, π/μ), Espeholt et al. 2018, arXiv 1802.01561)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trueflow.rl.decoupled import decoupled_surrogate, proximal_ratio, truncated_is_weight
from trueflow.rl.grpo_guard import step_weight
from trueflow.rl.loss import ppo_clip_loss

EPS_CLIP = 0.2
CAP = 1.5
# log(π_θ/π_prox): outside the trust region on both sides, with both signs of the advantage, and inside it
LOG_RATIO = np.array([1.0, 1.0, -1.0, -1.0, 0.05, -0.05, 0.6, -0.7])
ADV = np.array([1.5, -1.5, 1.5, -1.5, 0.8, -0.8, -2.0, 2.0])
# log(π_prox/μ): weights below 1, near 1, and above the cap (truncated)
LOG_BEHAVIOUR = np.array([-0.3, 0.9, 0.2, 0.0, 1.2, -1.0, 0.4, 0.45])


def _oracle(logp: np.ndarray, prox: np.ndarray, behaviour: np.ndarray, adv: np.ndarray, eps: float, cap: float,
            pair_weight: np.ndarray | None = None):
    """float64 loss and d loss / d logp with π_prox held fixed."""
    w = np.minimum(cap, np.exp(prox - behaviour))
    if pair_weight is not None:
        w = w * pair_weight
    r = np.exp(logp - prox)
    unclipped, clipped = -adv * r, -adv * np.clip(r, 1 - eps, 1 + eps)
    loss = (w * np.maximum(unclipped, clipped)).mean()
    grad = w * np.where(unclipped >= clipped, -adv * r, 0.0) / len(r)
    return loss, grad


def _t(a: np.ndarray, **kw) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float32, **kw)


def test_truncated_weight_is_vtrace_min_of_cap_and_the_ratio():
    prox = np.linspace(-3.0, 1.0, len(LOG_BEHAVIOUR))
    p = _t(prox, requires_grad=True)
    w = truncated_is_weight(p, _t(prox - LOG_BEHAVIOUR), CAP)
    np.testing.assert_allclose(w.double().numpy(), np.minimum(CAP, np.exp(LOG_BEHAVIOUR)), rtol=1e-6)
    assert (w == CAP).sum() == (np.exp(LOG_BEHAVIOUR) > CAP).sum() >= 2, "the cap binds where the ratio exceeds it"
    assert (w < 1).any(), "a weight below 1 is kept as it is (truncation is from above only)"
    assert not w.requires_grad, "the weight is data: no gradient flows through it"
    with pytest.raises(ValueError, match=">= 1"):
        truncated_is_weight(p, p, 0.5)


def test_decoupled_loss_and_gradient_match_float64_against_a_general_proximal_policy():
    prox = np.linspace(-3.0, 1.0, len(LOG_RATIO))
    behaviour = prox - LOG_BEHAVIOUR
    logp = _t(prox + LOG_RATIO, requires_grad=True)
    p, mu = _t(prox), _t(behaviour)
    loss, stats = decoupled_surrogate(torch.exp(logp - p), _t(ADV), EPS_CLIP, truncated_is_weight(p, mu, CAP))
    loss.backward()
    want_loss, want_grad = _oracle(logp.detach().double().numpy(), prox, behaviour, ADV, EPS_CLIP, CAP)
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(logp.grad.double().numpy(), want_grad, rtol=1e-6, atol=1e-9)
    assert stats.clip_frac == pytest.approx(float((np.abs(np.exp(LOG_RATIO) - 1) > EPS_CLIP).mean()))


def test_with_the_policy_before_the_step_as_proximal_the_step_is_the_weighted_policy_gradient():
    """π_prox = π_θ before the step (what the trainer uses): r = 1 in value, the clip does not bind, and
    d L / d logp = −w·A / B with w = min(ρ̄, π_θ/μ)."""
    logp = _t(np.linspace(-3.0, 1.0, len(ADV)), requires_grad=True)
    behaviour = logp.detach().double().numpy() - LOG_BEHAVIOUR
    ratio = proximal_ratio(logp)
    assert torch.equal(ratio, torch.ones_like(ratio))
    w = truncated_is_weight(logp, _t(behaviour), CAP)
    loss, stats = decoupled_surrogate(ratio, _t(ADV), EPS_CLIP, w)
    loss.backward()
    want_w = np.minimum(CAP, np.exp(LOG_BEHAVIOUR))
    assert loss.item() == pytest.approx(-(want_w * ADV).mean(), abs=1e-7)
    np.testing.assert_allclose(logp.grad.double().numpy(), -want_w * ADV / len(ADV), rtol=1e-6)
    assert stats.clip_frac == 0.0


def test_a_per_pair_weight_multiplies_the_importance_weight():
    """GRPO-Guard's step reweighting 1/|dt| composes with w: each pair's surrogate is weighted by w/|dt|."""
    prox = np.linspace(-3.0, 1.0, len(LOG_RATIO))
    behaviour = prox - LOG_BEHAVIOUR
    dt = np.array([-0.1, -0.2, -0.05, -0.1, -0.3, -0.15, -0.25, -0.05])
    logp = _t(prox + LOG_RATIO, requires_grad=True)
    p = _t(prox)
    loss, _ = decoupled_surrogate(torch.exp(logp - p), _t(ADV), EPS_CLIP, truncated_is_weight(p, _t(behaviour), CAP),
                                  step_weight(_t(dt)))
    loss.backward()
    want_loss, want_grad = _oracle(logp.detach().double().numpy(), prox, behaviour, ADV, EPS_CLIP, CAP,
                                   1 / np.abs(dt))
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(logp.grad.double().numpy(), want_grad, rtol=1e-6, atol=1e-9)


def test_on_policy_the_decoupled_loss_is_ppos_bit_for_bit():
    """μ = π_prox = π_θ (a rollout made with the current weights): w = 1 exactly, and the loss and its gradient are
    the synchronous PPO-clip's, bit for bit — so a staleness-0 step of an async run is a sync run's step."""
    adv = _t(ADV)
    a = _t(np.linspace(-3.0, 1.0, len(ADV)), requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    sync, _ = ppo_clip_loss(a, a.detach().clone(), adv, EPS_CLIP)
    w = truncated_is_weight(b, b.detach().clone(), CAP)
    assert torch.equal(w, torch.ones_like(w))
    decoupled, _ = decoupled_surrogate(proximal_ratio(b), adv, EPS_CLIP, w)
    sync.backward()
    decoupled.backward()
    assert torch.equal(sync, decoupled) and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("async_rollouts", [1, 0])
def test_the_trainers_policy_loss_is_the_oracles(async_rollouts):
    """The trainer's wiring of the objective (`Trainer._policy_loss`), not only the functions: with
    --async-rollouts the behaviour log-prob it weights by is the engine's recorded one (b.old_log_prob = log μ) and
    π_prox is the current forward, so d L / d logp = −min(ρ̄, π_θ/μ)·A / B; without, PPO-clip against the recorded
    log-prob (the oracle with π_prox = μ: w = 1)."""
    from types import SimpleNamespace

    from trueflow.train.trainer import Trainer

    logp = _t(np.linspace(-3.0, 1.0, len(ADV)), requires_grad=True)
    current = logp.detach().double().numpy()
    recorded = current - (LOG_BEHAVIOUR if async_rollouts else LOG_RATIO)
    cfg = SimpleNamespace(algorithm="grpo", async_rollouts=async_rollouts, ratio_norm="none", clip_range=EPS_CLIP,
                          async_is_cap=CAP)
    batch = SimpleNamespace(advantages=_t(ADV), old_log_prob=_t(recorded))
    loss, _ = Trainer._policy_loss(SimpleNamespace(cfg=cfg), batch, None, logp, None, None)
    loss.backward()
    prox = current if async_rollouts else recorded
    want_loss, want_grad = _oracle(current, prox, recorded, ADV, EPS_CLIP, CAP)
    # float32 against float64: w = exp(logp − log μ) rounds once more than the oracle (a few ulps), nothing a
    # mutation (w = 1, μ and π swapped, the cap dropped) could hide in
    assert loss.item() == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(logp.grad.double().numpy(), want_grad, rtol=1e-5, atol=1e-9)
