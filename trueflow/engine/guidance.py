"""True classifier-free guidance with norm rescale: one function for the rollout engine and the trainer."""

from __future__ import annotations

import torch


def true_cfg(positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
    """`guided = neg + s·(pos − neg)`, rescaled to the positive branch's norm along the last dim.

    The operations, their order and their dtype are `QwenImagePipeline.__call__`'s: every op runs in the
    model output's dtype (bf16), so each of `pos − neg`, `s·`, `neg +`, both norms, the ratio and the product
    rounds separately; `s·pos + (1−s)·neg` or fp32 norms would round differently. `scale` stays a python float,
    as in the pipeline (a tensor scale would change type promotion). The one change: the guided norm is clamped
    at 1e-12, so a zero guided vector gives 0 rather than NaN; for any non-zero norm the bits are the pipeline's.
    The two branches must come from two separate forwards, never one concatenated batch: a batch of both
    branches runs GEMMs of another shape, which rounds bf16 differently on a GPU.
    """
    guided = negative + scale * (positive - negative)
    positive_norm = torch.norm(positive, dim=-1, keepdim=True)
    guided_norm = torch.norm(guided, dim=-1, keepdim=True)
    return guided * (positive_norm / guided_norm.clamp_min(1e-12))
