"""RMSNorm with a learned weight (e.g. Qwen-Image's text input norm), the affine LayerNorm computed in fp32 (Wan2.2's
cross-attention norm), and the fp32 RMS normalisation every fast norm here is built on (the q/k norms: `rope.py`;
the modulated norms: `modulation.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels


def rms_f32(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """`x·rsqrt(mean(x²)+eps)` over the last dim, times `weight` if given, all in fp32 (unrounded)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Serving-engine RMSNorm: normalise and scale in fp32, round to the input dtype once at the end (a Triton
    kernel on CUDA, this PyTorch code elsewhere)."""
    if kernels.use_triton(x):
        return kernels.ops().rms_norm(x, weight, eps)
    return rms_f32(x, eps, weight).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.impl = rms_norm_fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps)


def layer_norm_f32(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm of `x` with its affine weight and bias, all in fp32, rounded to x's dtype once: diffusers'
    `FP32LayerNorm` on `x.float()` then `.type_as(x)` (fp32 arithmetic throughout, so a fused kernel rounds alike)."""
    return F.layer_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(),
                        None if bias is None else bias.float(), eps).to(x.dtype)


class LayerNorm(nn.Module):
    """Affine LayerNorm computed in fp32 (`layer_norm_f32`); its weight and bias may be held in fp32 (diffusers'
    `_keep_in_fp32_modules`, e.g. Wan2.2's `norm2`)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.impl = layer_norm_f32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.bias, self.eps)
