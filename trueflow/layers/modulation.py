"""adaLN modulation: LayerNorm + scale/shift, the gated residual, and the mul-add `c + a*(k+b)`.

The fast kernels compute in fp32 and round once per output (Triton kernels on CUDA, `trueflow.kernels`; the PyTorch
code here elsewhere); the reference (diffusers, bf16 without autocast) rounds after every elementwise op.
Shift/scale/gate arrive as [B, D] and broadcast over the sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels


def _layer_norm_f32(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


def layer_norm_scale_shift_fused(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """`LN(x)·(1+scale)+shift` in fp32, one rounding."""
    if kernels.use_triton(x):
        return kernels.ops().layer_norm_scale_shift(x, shift, scale, eps)
    y = _layer_norm_f32(x, eps) * (1.0 + scale.float()[:, None]) + shift.float()[:, None]
    return y.to(x.dtype)


def scale_residual_layer_norm_scale_shift_fused(
    residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`r = residual + gate·y`; returns (r, LN(r)·(1+scale)+shift). Everything in fp32: `r` is rounded once for the
    residual stream, and the norm reads the unrounded fp32 `r`, as a fused kernel keeps it in registers."""
    if kernels.use_triton(residual):
        return kernels.ops().scale_residual_layer_norm_scale_shift(residual, y, gate, shift, scale, eps)
    r = residual.float() + gate.float()[:, None] * y.float()
    out = _layer_norm_f32(r, eps) * (1.0 + scale.float()[:, None]) + shift.float()[:, None]
    return r.to(residual.dtype), out.to(residual.dtype)


def mul_add_fused(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, k: float) -> torch.Tensor:
    """`c + a·(k+b)` in fp32, one rounding. `b` is [B, D] and broadcasts over the sequence."""
    if kernels.use_triton(a):
        return kernels.ops().mul_add(a, b, c, k)
    return (c.float() + a.float() * (k + b.float()[:, None])).to(a.dtype)


class LayerNormScaleShift(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.impl = layer_norm_scale_shift_fused

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.impl(x, shift, scale, self.eps)


class ScaleResidualLayerNormScaleShift(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.impl = scale_residual_layer_norm_scale_shift_fused

    def forward(self, residual, y, gate, shift, scale) -> tuple[torch.Tensor, torch.Tensor]:
        return self.impl(residual, y, gate, shift, scale, self.eps)


class MulAdd(nn.Module):
    """`c + a·(k+b)`; with k=0 it is the gated residual `c + a·b`."""

    def __init__(self, k: float):
        super().__init__()
        self.k = k
        self.impl = mul_add_fused

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.impl(a, b, c, self.k)
