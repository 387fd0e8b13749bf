"""PPO-clip policy loss and flow-GRPO's KL penalty for one micro-batch of (sample, step) pairs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLERS = ("sde", "cps")


@dataclass
class PolicyLossStats:
    ratio_mean: float
    ratio_max_abs_dev_from_1: float
    clip_frac: float


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float,
                      weight: torch.Tensor | None = None) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO's clipped surrogate as a loss (Schulman et al. 2017, Eq. 7, negated):
    `mean(w · max(−A·r, −A·clip(r, 1−ε, 1+ε)))` over the [B] pairs, `w` = 1 unless a per-pair `weight` is given
    (GRPO-Guard's step reweighting, `grpo_guard.step_weight`)."""
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_pair = torch.maximum(-advantages * ratio, -advantages * clipped)
    loss = (per_pair if weight is None else weight * per_pair).mean()
    with torch.no_grad():
        stats = PolicyLossStats(ratio_mean=ratio.mean().item(),
                                ratio_max_abs_dev_from_1=(ratio - 1).abs().max().item(),
                                clip_frac=((ratio - 1).abs() > clip_range).float().mean().item())
    return loss, stats


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float) -> tuple[torch.Tensor, PolicyLossStats]:
    """`clipped_surrogate` of `r = exp(logp − logp_old)`; all [B] fp32. The stats are read before any optimizer
    step, so on-policy (bitwise parity) the ratio is exactly 1."""
    return clipped_surrogate(torch.exp(log_prob - old_log_prob), advantages, clip_range)


def kl_penalty(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, dt: torch.Tensor,
               sampler: str) -> torch.Tensor:
    """flow-GRPO's KL to the reference (LoRA-disabled) policy, per sample: the mean over non-batch dims of
    `(μ − μ_ref)²`, over `2·s²`, with `s` the `std_dev_t` flow-GRPO's sampler returns (`sde_step_with_logprob`)
    and its `train_*.py` divides by:

    - `"sde"`: the SDE's diffusion coefficient `a·sqrt(σ/(1−σ))`, i.e. the transition std `std` of
      `samplers.sde_log_prob` (which includes `sqrt|dt|`) divided by `sqrt|dt|`;
    - `"cps"`: CPS's transition std `σ_next·sin(a·π/2)`, which is `samplers.cps_log_prob`'s `std` as it is.

    A pair whose transition is deterministic (`std` = 0: CPS's last step, σ_next = 0) has no Gaussian KL; it is
    excluded (its entry is 0, with a zero gradient). `mean` [B, ...], `std` and `dt` [B] or 0-dim; returns [B].
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"kl_penalty: sampler must be one of {SAMPLERS}, got {sampler!r}")
    var = std.float().reshape(-1) ** 2
    if sampler == "sde":
        var = var / dt.float().abs().reshape(-1)
    sq = ((mean.float() - ref_mean.float()) ** 2).flatten(1).mean(dim=1)
    defined = var > 0
    # The inner where keeps 0/0 out of the graph: a NaN in the unselected branch would still poison the gradient.
    return torch.where(defined, sq / (2 * torch.where(defined, var, 1.0)), 0.0)
