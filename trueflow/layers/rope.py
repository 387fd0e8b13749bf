"""Fused qk-norm + rotary embedding, with real cos/sin tables.

Rotary pairs are interleaved: (x[2i], x[2i+1]) rotate together by angle[i], as Qwen-Image's
complex-number formulation has them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels


@dataclass
class RopeTables:
    """Per-stream rotation tables for one forward; `cos`/`sin` (fast) or `freqs` (complex) is set."""

    cos: torch.Tensor | None = None  # [S, D/2] fp32
    sin: torch.Tensor | None = None
    freqs: torch.Tensor | None = None  # [S, D/2] complex64


def rope_tables_fused(positions: torch.Tensor, axes_dim: tuple[int, ...], theta: float, device) -> RopeTables:
    """Angles computed directly on the device in fp32: `pos · theta^(-2j/d)` per axis, then cos/sin."""
    angles = []
    for axis, dim in enumerate(axes_dim):
        inv_freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-torch.log(torch.tensor(float(theta))).item() / dim))
        angles.append(positions[:, axis].to(device=device, dtype=torch.float32)[:, None] * inv_freq[None, :])
    a = torch.cat(angles, dim=-1)
    return RopeTables(cos=a.cos(), sin=a.sin())


def into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`y`, or `y` copied into `out` (a view of the joint attention buffer) when one is given."""
    return y if out is None else out.copy_(y)


def qk_norm_rope_fused(x: torch.Tensor, weight: torch.Tensor, eps: float, tables: RopeTables,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """RMS-normalise each head and rotate it, all in fp32, rounding once. x: [B, S, H, D]; the result goes into
    `out` (a [B, S, H, D] view) if given. A Triton kernel on CUDA, this PyTorch code elsewhere."""
    if kernels.use_triton(x):
        return kernels.ops().qk_norm_rope(x, weight, eps, tables.cos, tables.sin, out)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    cos, sin = tables.cos[:, None, :], tables.sin[:, None, :]
    x_even, x_odd = xf[..., 0::2], xf[..., 1::2]
    y = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2)
    return into(y.to(x.dtype), out)


class QKNormRope(nn.Module):
    """q or k: per-head RMSNorm (learned weight over head_dim) followed by the rotary embedding."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.impl = qk_norm_rope_fused

    def forward(self, x: torch.Tensor, tables: RopeTables, out: torch.Tensor | None = None) -> torch.Tensor:
        """Into `out` (a [B, S, H, D] view, e.g. this stream's rows of the joint q or k buffer) if given."""
        return self.impl(x, self.weight, self.eps, tables, out)
