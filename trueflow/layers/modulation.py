"""adaLN modulation and gates: LayerNorm or RMSNorm + scale/shift, the bare scale/shift, the gated residual (alone
and fused with the next norm), and the per-head attention gate.

The fast kernels compute in fp32 and round once per output (Triton kernels on CUDA, `trueflow.kernels`; the PyTorch
code here elsewhere); a family's reference (diffusers in bf16 without autocast) rounds after every elementwise op.
Modulation rows (shift, scale, gate) arrive as [B, D] (one row per sample: Qwen-Image, SD3, FLUX, Wan) or [B, T, D]
(T = 1 or every token: LTX-2.3) and broadcast over the tokens (`rows`); the kernels take both.

The gated residual is one block for every family: Qwen-Image's `c + gate·y` and LTX-2.3's `residual + y·gate` are
the same arithmetic, the product then the sum (two roundings in eager bf16, one in the fused op; the product
commutes exactly). The Triton mul-add `c + a·(k+b)` is that block for k = 0; for k = 1 it is the modulation
`x·(1+scale)+shift`, which rounds once more in eager bf16 (`1+scale`): `ScaleShift`, a block of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .norms import rms_f32


def rows(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Modulation rows `t` for `x` [B, S, D]: [B, D] gets a token axis, [B, T, D] stays as it is."""
    return t[:, None] if t.dim() == x.dim() - 1 else t


def kernel_rows(x: torch.Tensor, *row_tensors: torch.Tensor) -> bool:
    """Whether the kernels take these shapes: x [B, S, D] and rows [B, D] or [B, 1 or S, D]."""
    return x.dim() == 3 and all(t.dim() == 2 or (t.dim() == 3 and t.shape[1] in (1, x.shape[1])) for t in row_tensors)


def _triton_rows(x: torch.Tensor, *row_tensors: torch.Tensor) -> bool:
    """Whether the Triton kernel runs: CUDA (`kernels.use_triton`) and shapes it takes (`kernel_rows`)."""
    return kernels.use_triton(x) and kernel_rows(x, *row_tensors)


def _layer_norm_f32(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


# -- the fast functions (fp32 inside, one rounding) ----------------------------------------------------------------
def layer_norm_scale_shift_fused(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """`LN(x)·(1+scale)+shift` in fp32, one rounding."""
    if _triton_rows(x, shift, scale):
        return kernels.ops().layer_norm_scale_shift(x, shift, scale, eps)
    y = _layer_norm_f32(x, eps) * (1.0 + rows(scale, x).float()) + rows(shift, x).float()
    return y.to(x.dtype)


def scale_residual_layer_norm_scale_shift_fused(
    residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`r = residual + gate·y`; returns (r, LN(r)·(1+scale)+shift). Everything in fp32: `r` is rounded once for the
    residual stream, and the norm reads the unrounded fp32 `r`, as a fused kernel keeps it in registers."""
    if _triton_rows(residual, gate, shift, scale):
        return kernels.ops().scale_residual_layer_norm_scale_shift(residual, y, gate, shift, scale, eps)
    r = residual.float() + rows(gate, residual).float() * y.float()
    out = _layer_norm_f32(r, eps) * (1.0 + rows(scale, residual).float()) + rows(shift, residual).float()
    return r.to(residual.dtype), out.to(residual.dtype)


def rms_norm_scale_shift_fused(x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None,
                               eps: float) -> torch.Tensor:
    """`RMSNorm(x)·(1+scale)+shift` (no norm weight) in fp32, one rounding; without scale, the bare norm."""
    if (shift is None) != (scale is None):
        raise ValueError("shift and scale come together, or neither (the bare norm)")
    if shift is not None and scale is not None and _triton_rows(x, shift, scale):
        return kernels.ops().rms_norm_scale_shift(x, shift, scale, eps)
    y = rms_f32(x, eps)
    if shift is not None and scale is not None:
        y = y * (1 + rows(scale, x).float()) + rows(shift, x).float()
    return y.to(x.dtype)


def scale_shift_fused(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x·(1+scale)+shift` in fp32, one rounding."""
    if _triton_rows(x, shift, scale):
        return kernels.ops().scale_shift(x, shift, scale)
    return (x.float() * (1 + rows(scale, x).float()) + rows(shift, x).float()).to(x.dtype)


def gated_residual_fused(y: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + y·gate` in fp32, one rounding (Triton's mul-add `c + a·(k+b)` with k = 0 on CUDA)."""
    if _triton_rows(y, gate):
        return kernels.ops().mul_add(y, gate, residual, 0.0)
    return (residual.float() + y.float() * rows(gate, y).float()).to(residual.dtype)


def attention_gate_fused(out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-head gate `out·2σ(logits)` (out [B, S, H, D], logits [B, S, H]) in fp32, one rounding."""
    if kernels.use_triton(out):
        return kernels.ops().attention_gate(out, logits)
    return (out.float() * (2.0 * torch.sigmoid(logits.float())).unsqueeze(-1)).to(out.dtype)


# -- the modules: `impl` is the fast function until a family's patch group swaps it --------------------------------
class LayerNormScaleShift(nn.Module):
    """`LN(x)·(1+scale)+shift`, LayerNorm without affine weights."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.impl = layer_norm_scale_shift_fused

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.impl(x, shift, scale, self.eps)


class ScaleResidualLayerNormScaleShift(nn.Module):
    """The gated residual and the next norm's modulation in one op: (r, LN(r)·(1+scale)+shift), r = residual +
    gate·y."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.impl = scale_residual_layer_norm_scale_shift_fused

    def forward(self, residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.impl(residual, y, gate, shift, scale, self.eps)


class RMSNormScaleShift(nn.Module):
    """`RMSNorm(x)·(1+scale)+shift`, RMSNorm without a weight; called without shift/scale, the bare norm."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.impl = rms_norm_scale_shift_fused

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.impl(x, shift, scale, self.eps)


class ScaleShift(nn.Module):
    """`x·(1+scale)+shift` with no norm before it (e.g. LTX-2.3's per-block text key/value modulation)."""

    def __init__(self):
        super().__init__()
        self.impl = scale_shift_fused

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.impl(x, shift, scale)


class GatedResidual(nn.Module):
    """`residual + y·gate`: a block's attention or MLP output added to the residual stream through its gate."""

    def __init__(self):
        super().__init__()
        self.impl = gated_residual_fused

    def forward(self, y: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.impl(y, gate, residual)


class AttentionGate(nn.Module):
    """Per-head attention output gate `out·2σ(logits)` (LTX-2.3's gated attention)."""

    def __init__(self):
        super().__init__()
        self.impl = attention_gate_fused

    def forward(self, out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.impl(out, logits)
