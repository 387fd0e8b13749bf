"""The decoupled PPO objective for rollouts made by an older policy (`--async-rollouts`), with a truncated
behaviour importance weight.

Three policies take part (Hilton et al. 2021, "Batch size-invariance for policy optimization", arXiv 2110.00641;
Fu et al. 2025, AReaL, arXiv 2505.24298, its "decoupled PPO objective" for asynchronous RL):

- μ, the behaviour policy: the weights the engine rolled out with. Its log-probs are the engine's records, exact
  because the engine is bitwise with the train forward (the trainer proves it at every step, `parity_monitor`);
- π_prox, the proximal policy: the one the trust region is drawn around. Here the policy before the optimizer step
  (the current weights), so it costs no forward: its log-prob is the current forward's, detached;
- π_θ, the policy being optimized.

    L(θ) = −mean_i [ w_i · min( r_i·A_i, clip(r_i, 1 − ε, 1 + ε)·A_i ) ],   r_i = π_θ / π_prox,
    w_i = min(ρ̄, π_prox / μ)   (no gradient)

`w` is IMPALA's truncated importance weight (Espeholt et al. 2018, arXiv 1802.01561, V-trace:
ρ_t = min(ρ̄, π(a_t|x_t) / μ(a_t|x_t))): it corrects the behaviour policy's sampling, and its cap ρ̄ bounds the
variance a very unlikely sample could add. (AReaL's code drops a sample whose weight exceeds its cap instead;
V-trace keeps it at the cap.) When μ = π_prox, w = 1 and L is PPO's clipped surrogate (`loss.clipped_surrogate`).

As elsewhere in trueflow a "probability" is the exponential of the per-element mean log-prob of one denoising
transition (`engine.samplers`), as flow-GRPO forms its ratio.
"""

from __future__ import annotations

import torch

from .loss import PolicyLossStats, clipped_surrogate


def proximal_ratio(log_prob: torch.Tensor) -> torch.Tensor:
    """`r = π_θ / π_prox` with π_prox the policy before the step: `exp(logp − sg(logp))`, exactly 1 in value, with
    the gradient of `logp` (so the clip of one step never binds, as on-policy PPO's first step)."""
    return torch.exp(log_prob - log_prob.detach())


def truncated_is_weight(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                        cap: float) -> torch.Tensor:
    """V-trace's `min(ρ̄, π_prox / μ)` per pair, no gradient; `cap` = ρ̄ ≥ 1. [B] fp32."""
    if cap < 1:
        raise ValueError(f"the importance weight's cap must be >= 1, got {cap}")
    ratio = torch.exp(proximal_log_prob.detach().float() - behaviour_log_prob.float())
    return torch.clamp(ratio, max=cap)


def decoupled_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float, is_weight: torch.Tensor,
                        weight: torch.Tensor | None = None) -> tuple[torch.Tensor, PolicyLossStats]:
    """The decoupled objective as a loss: `mean(w · max(−A·r, −A·clip(r, 1−ε, 1+ε)))` with `r = π_θ / π_prox`
    (`proximal_ratio`, or GRPO-Guard's normalised ratio against π_prox), `w` = `is_weight`
    (`truncated_is_weight`) times an optional per-pair `weight` (GRPO-Guard's step reweighting)."""
    w = is_weight.detach() if weight is None else is_weight.detach() * weight
    return clipped_surrogate(ratio, advantages, clip_range, w)
