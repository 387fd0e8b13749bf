"""Rotary embeddings and the q/k RMSNorm before them, per head or across heads.

Which channels rotate together is a property of a family's tables (`RopeTables.pairs`): interleaved pairs (x[2i],
x[2i+1]) by angle[i], as Qwen-Image's complex-number formulation (and FLUX's, Wan's) has them, or split halves (x[i],
x[i + D/2]), as LTX-2.3's split RoPE has them. The q/k norm is a choice of the family too: RMSNorm over each head's
D channels (weight [D]: Qwen-Image, SD3, FLUX) or over all heads' H·D channels at once (weight [H·D]: LTX-2.3, Wan).
Each family builds its own tables (positions are the family's); the multi-axis table of `rope_tables_fused` is the
fast form of the per-axis `pos · theta^(-2j/d)` RoPE several families share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels
from .norms import rms_f32

PAIRS = ("interleaved", "split")


@dataclass(frozen=True)
class RopeTables:
    """One stream's rotation tables for one forward: real `cos`/`sin` (fp32; the fast paths) or complex `freqs`
    (complex64 [S, D/2]; a reference that multiplies complex numbers, as diffusers' Qwen-Image does).

    cos/sin: [S, D/2], one table every head shares, or [1, H, S, D/2], one per head (heads-major, as diffusers
    builds LTX-2's split RoPE)."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    freqs: torch.Tensor | None = None
    pairs: str = "interleaved"  # one of PAIRS

    def __post_init__(self):
        if self.pairs not in PAIRS:
            raise ValueError(f"unknown rotary pairing {self.pairs!r}; choose one of {', '.join(PAIRS)}")


def rope_tables_fused(positions: torch.Tensor, axes_dim: tuple[int, ...], theta: float, device) -> RopeTables:
    """Interleaved tables [S, D/2] for integer positions [S, n_axes], angles computed directly on the device in
    fp32: `pos · theta^(-2j/d)` per axis (d its share of the head), then cos/sin."""
    angles = []
    for axis, dim in enumerate(axes_dim):
        inv_freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32)
                             * (-torch.log(torch.tensor(float(theta))).item() / dim))
        angles.append(positions[:, axis].to(device=device, dtype=torch.float32)[:, None] * inv_freq[None, :])
    a = torch.cat(angles, dim=-1)
    return RopeTables(cos=a.cos(), sin=a.sin())


def _per_token(t: torch.Tensor) -> torch.Tensor:
    """A cos or sin table as [S, 1 or H, D/2], broadcasting against [B, S, H, D/2]."""
    return t[:, None, :] if t.dim() == 2 else t[0].transpose(0, 1)


def rotate_f32(y: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """y (fp32 [B, S, H, D]) rotated by the real tables, in fp32 (unrounded): each pair (a, b) -> (a·cos - b·sin,
    a·sin + b·cos)."""
    if tables.cos is None or tables.sin is None:
        raise ValueError("the fast rotation takes real cos/sin tables; complex `freqs` tables are a reference's")
    cos, sin = _per_token(tables.cos), _per_token(tables.sin)
    if tables.pairs == "interleaved":
        x_even, x_odd = y[..., 0::2], y[..., 1::2]
        return torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2)
    a, b = y.unflatten(-1, (2, -1)).unbind(-2)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`y`, or `y` copied into `out` (a view of the joint attention buffer) when one is given."""
    return y if out is None else out.copy_(y)


def qk_norm_rope_fused(x: torch.Tensor, weight: torch.Tensor, eps: float, tables: RopeTables | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """RMS-normalise each head (x [B, S, H, D], weight [D]) and rotate it if tables are given, all in fp32, rounding
    once; the result goes into `out` (a [B, S, H, D] view) if given. A Triton kernel on CUDA for interleaved tables
    shared by every head, this PyTorch code elsewhere."""
    if kernels.use_triton(x) and tables is not None and tables.pairs == "interleaved" and \
            tables.cos is not None and tables.cos.dim() == 2:
        return kernels.ops().qk_norm_rope(x, weight, eps, tables.cos, tables.sin, out)
    y = rms_f32(x, eps, weight)
    if tables is not None:
        y = rotate_f32(y, tables)
    return into(y.to(x.dtype), out)


def qk_norm_across_heads_rope_fused(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int,
                                    tables: RopeTables | None) -> torch.Tensor:
    """RMSNorm across all heads (x [B, S, H·D], weight [H·D]), then each head rotated if tables are given, all in
    fp32, rounding once. Returns [B, S, H, D]. A Triton kernel on CUDA (real tables, either pairing, shared by the
    heads or per head), this PyTorch code elsewhere."""
    if kernels.use_triton(x) and (tables is None or tables.cos is not None):
        cos, sin = (None, None) if tables is None else (tables.cos, tables.sin)
        return kernels.ops().qk_norm_across_heads_rope(x.unflatten(-1, (heads, -1)), weight, eps, cos, sin,
                                                       split=tables is not None and tables.pairs == "split")
    y = rms_f32(x, eps, weight).unflatten(-1, (heads, -1))
    if tables is not None:
        y = rotate_f32(y, tables)
    return y.to(x.dtype)


class QKNormRope(nn.Module):
    """q or k: per-head RMSNorm (learned weight over head_dim) followed by the rotary embedding, if tables are
    given."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.impl = qk_norm_rope_fused

    def forward(self, x: torch.Tensor, tables: RopeTables | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Into `out` (a [B, S, H, D] view, e.g. this stream's rows of the joint q or k buffer) if given."""
        return self.impl(x, self.weight, self.eps, tables, out)


class QKNormAcrossHeadsRope(nn.Module):
    """q or k: RMSNorm across all heads (diffusers' `torch.nn.RMSNorm(heads·head_dim)`, "rms_norm_across_heads"),
    then the rotary embedding if tables are given; [B, S, H·D] in, [B, S, H, D] out."""

    def __init__(self, dim: int, heads: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.heads = eps, heads
        self.weight = nn.Parameter(torch.ones(dim))
        self.impl = qk_norm_across_heads_rope_fused

    def forward(self, x: torch.Tensor, tables: RopeTables | None) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps, self.heads, tables)
