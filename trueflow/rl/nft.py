"""DiffusionNFT (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
arXiv 2509.16117): policy optimisation on the forward (noising) process by flow matching, contrasting an
implicit positive and an implicit negative policy. Likelihood-free: it needs only the clean samples of any
sampler, their rewards, and the rollout ("old") policy's velocity; no CFG and no KL.

Rectified flow as Qwen-Image's scheduler uses it (paper Sec. 2.1 with `α_t = 1 − t`, `σ_t = t`):
`x_t = (1 − t)·x0 + t·ε` and the velocity target `v = ε − x0`; `t` is the sigma.
"""

from __future__ import annotations

import torch

WEIGHT_FLOOR = 1e-5  # the official code's floor on the adaptive weight (scripts/train_nft_sd3.py)


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(-1, *([1] * (like.ndim - 1)))


def _mean(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).mean(dim=1)


def optimality(advantages: torch.Tensor, clip_max: float) -> torch.Tensor:
    """The optimality probability `r = 1/2 + 1/2·clip((r_raw − E_c r_raw)/Z_c, −1, 1)` (paper Sec. 3.3,
    "Optimality Reward"; Algorithm 1 line 5) from GRPO advantages `(r_raw − mean)/(std + 1e-4)`, i.e. with
    `Z_c = clip_max·(std + 1e-4)`, as the official code maps its advantages: `r = clip(A/clip_max, −1, 1)/2 + 1/2`."""
    return 0.5 + 0.5 * (advantages.float() / clip_max).clamp(-1.0, 1.0)


def forward_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`x_t = (1 − t)·x0 + t·ε` in fp32 (paper Sec. 2.1, rectified flow; Algorithm 1 line 9); `t` [B]."""
    tt = _per_sample(t, x0)
    return (1 - tt) * x0.float() + tt * noise.float()


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             r: torch.Tensor, beta: float, adaptive_weight: bool = True) -> torch.Tensor:
    """Per-sample DiffusionNFT loss (paper Eq. 5, Theorem 3.2), divided by β as the official code divides it:

    `(r·L(v⁺) + (1 − r)·L(v⁻)) / β`, `v⁺ = (1 − β)·v_old + β·v` (implicit positive policy),
    `v⁻ = (1 + β)·v_old − β·v` (implicit negative policy), whose optimum is `v* = v_old + (2/β)·Δ` (Eq. 6).

    `L(u) = mean((u − (ε − x0))²)` (Eq. 1 with w = 1) or, with `adaptive_weight` (Sec. 3.3, "Adaptive Loss
    Weighting"), the self-normalised x0 regression `mean((x̂0 − x0)²) / sg(mean|x̂0 − x0|)` with
    `x̂0 = x_t − t·u`, the weight floored at 1e-5 as in the official code. The model must have been run at
    `forward_noise(x0, noise, t)`. `v` (with grad) and `v_old` (the rollout policy's, no grad) [B, ...];
    `t`, `r` [B]. The official code further multiplies the batch mean by `adv_clip_max`, a constant.
    """
    v, v_old = v.float(), v_old.float().detach()
    v_pos = (1 - beta) * v_old + beta * v
    v_neg = (1 + beta) * v_old - beta * v
    if adaptive_weight:
        x_t, tt = forward_noise(x0, noise, t), _per_sample(t, x0)

        def branch(u: torch.Tensor) -> torch.Tensor:
            err = x_t - tt * u - x0.float()
            return _mean(err**2) / _mean(err.detach().abs()).clamp_min(WEIGHT_FLOOR)
    else:
        target = noise.float() - x0.float()

        def branch(u: torch.Tensor) -> torch.Tensor:
            return _mean((u - target) ** 2)
    r = r.float().reshape(-1)
    return (r * branch(v_pos) + (1 - r) * branch(v_neg)) / beta
