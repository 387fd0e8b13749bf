"""PPO-clip policy loss and flow-GRPO's KL penalty for one micro-batch of (sample, step) pairs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossStats:
    ratio_mean: float
    ratio_max_abs_dev_from_1: float
    clip_frac: float


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float) -> tuple[torch.Tensor, PolicyLossStats]:
    """`mean(max(−A·r, −A·clip(r, 1±ε)))` with `r = exp(logp − logp_old)`; all [B] fp32. The stats are read
    before any optimizer step, so on-policy (bitwise parity) the ratio is exactly 1."""
    ratio = torch.exp(log_prob - old_log_prob)
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped).mean()
    with torch.no_grad():
        stats = PolicyLossStats(ratio_mean=ratio.mean().item(),
                                ratio_max_abs_dev_from_1=(ratio - 1).abs().max().item(),
                                clip_frac=((ratio - 1).abs() > clip_range).float().mean().item())
    return loss, stats


def kl_penalty(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """flow-GRPO's KL to the reference (LoRA-disabled) policy, per sample: the mean over non-batch dims of
    `(μ − μ_ref)²`, over `2·std_t²` where `std_t` is the SDE's diffusion coefficient — the transition std
    (`samplers.sde_*`'s `std`, which includes `sqrt|dt|`) divided by `sqrt|dt|`."""
    coeff_sq = (std.float() ** 2 / dt.float().abs()).reshape(-1)
    sq = ((mean.float() - ref_mean.float()) ** 2).flatten(1).mean(dim=1)
    return sq / (2 * coeff_sq)
