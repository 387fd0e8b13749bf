"""The classifier-free guidance formulas the families' pipelines compute (a family names one in its `Guidance`).

Each runs in the model output's dtype (bf16) with `scale` a python float, as the pipelines do: every op rounds
separately, so `s·pos + (1−s)·neg`, fp32 arithmetic or a tensor scale would give other bits.
"""

from __future__ import annotations

import torch


def plain_cfg(positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
    """`neg + s·(pos − neg)`: StableDiffusion3Pipeline's `noise_pred_uncond + guidance_scale · (noise_pred_text −
    noise_pred_uncond)`, WanPipeline's `noise_uncond + current_guidance_scale · (noise_pred − noise_uncond)`,
    FluxPipeline's true CFG `neg_noise_pred + true_cfg_scale · (noise_pred − neg_noise_pred)`."""
    return negative + scale * (positive - negative)


def rescaled_cfg(positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
    """`neg + s·(pos − neg)`, rescaled to the positive branch's norm along the last dim: QwenImagePipeline's
    `__call__` (both norms and the ratio in the output's dtype). The one change: the guided norm is clamped at
    1e-12, so a zero guided vector gives 0 rather than NaN; for any non-zero norm the bits are the pipeline's."""
    guided = plain_cfg(positive, negative, scale)
    positive_norm = torch.norm(positive, dim=-1, keepdim=True)
    guided_norm = torch.norm(guided, dim=-1, keepdim=True)
    return guided * (positive_norm / guided_norm.clamp_min(1e-12))
