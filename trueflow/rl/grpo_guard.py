"""GRPO-Guard (Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated
Clipping", arXiv 2510.22319): RatioNorm and the per-step gradient reweighting, for the SDE sampler.

Why: with the SDE's Gaussian transition `N(μ, s²)` (s = σ_t·sqrt(Δt), the transition std) and a sample
`x' = μ_old + s·ε` drawn by the old policy, the per-element-mean log-ratio is
`log r = mean(ε·Δμ)/s − mean(Δμ²)/(2s²)` with `Δμ = μ_θ − μ_old`: its mean is negative and its spread scales
with 1/s, different at every step, so a fixed clip range `1 ± ε` misses over-confident positive updates.
"""

from __future__ import annotations

import torch


def normalized_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                     std: torch.Tensor) -> torch.Tensor:
    """RatioNorm (paper Eq. 8): `r̂ = exp(s·(log r + mean(Δμ²)/(2s²)))`, `log r = logp − logp_old`,
    `Δμ = μ_θ − μ_old` averaged over the non-batch dims, `s` the transition std.

    Adding the bias back cancels the `−mean(Δμ²)/(2s²)` term and scaling by `s` removes the 1/s, so
    `log r̂ = mean(ε·Δμ)`: centred on 0 at every step. Use it with `samplers.sde_log_prob`'s log-prob (the
    normalised Gaussian one) and its `std`; CPS's log-prob drops the `1/(2s²)` and does not fit this formula.
    `mean` (with grad) and `old_mean` (the rollout policy's) [B, ...]; `std` [B] or 0-dim; returns [B].

    Per pair `s`: flow-GRPO's GRPO-Guard code takes the batch mean of `std_dev_t·sqrt_dt`, the same value when
    a micro-batch holds one step, as theirs always does; a trueflow micro-batch may hold several steps.
    """
    s = std.float().reshape(-1)
    bias = ((mean.float() - old_mean.float()) ** 2).flatten(1).mean(dim=1) / (2 * s**2)
    return torch.exp(s * (log_prob.float() - old_log_prob.float() + bias))


def step_weight(dt: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's gradient reweighting (paper Eq. 12) in its Flow-GRPO form `δ = 1/Δt`, per pair: the
    weight of that pair's clipped surrogate (`loss.clipped_surrogate(..., weight=step_weight(dt))`), so that
    every denoising step moves the policy by a comparable amount. `dt` = σ_next − σ, [B] or 0-dim."""
    return 1.0 / dt.float().abs().reshape(-1)
