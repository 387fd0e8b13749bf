"""GRPO advantages: rewards normalised within each prompt's group of samples."""

from __future__ import annotations

import torch

STD_EPS = 1e-4  # flow-GRPO's epsilon: a group with equal rewards gets advantage 0, not a division by 0


def group_advantages(rewards: torch.Tensor, n_per_prompt: int, clip_max: float = 5.0,
                     global_std: bool = False) -> torch.Tensor:
    """rewards: [P·n] in prompt-major order -> advantages [P·n]: `(r − mean_group) / (std + 1e-4)`, with the
    std of the group (default) or of all rewards, clipped to ±clip_max. NaN marks a sample whose group the
    reward skipped: it gets advantage 0 and takes no part in any statistic."""
    if rewards.ndim != 1 or rewards.numel() % n_per_prompt:
        raise ValueError(f"rewards must be a flat [P*{n_per_prompt}] tensor, got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, n_per_prompt)
    valid = ~torch.isnan(r)
    count = valid.sum(dim=1, keepdim=True).clamp_min(1)
    mean = torch.where(valid, r, 0.0).sum(dim=1, keepdim=True) / count
    centred = torch.where(valid, r - mean, 0.0)
    if global_std:
        std = centred.new_tensor(float(rewards[~torch.isnan(rewards)].float().std(unbiased=False)))
    else:
        std = (centred.pow(2).sum(dim=1, keepdim=True) / count).sqrt()
    return (centred / (std + STD_EPS)).clamp(-clip_max, clip_max).reshape(-1)
