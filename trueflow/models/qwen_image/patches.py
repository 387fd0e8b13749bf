"""The `qwen_image` rollout patch group: the engine's Qwen-Image numerics made bitwise equal to the train side.

The train side is diffusers' `QwenImageTransformer2DModel` in bf16 without autocast. Every `*_reference` function
here re-implements, op for op, the arithmetic diffusers runs, including each intermediate rounding to bf16;
tests compare each one with the diffusers function it mirrors. Nothing is imported from diffusers.

What the patches install are the `*_exact` functions: on CUDA in bf16 they run the eager-exact Triton kernels
(`kernels/triton_ops.py`, `*_eager_bf16`), which round after every op as the reference does, with the reductions
(LayerNorm, the RMS variance) left to the same PyTorch calls; elsewhere, or with `TRUEFLOW_TRITON=0`, the reference
itself. Either way the bits are the reference's.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ... import kernels
from ...layers.linear import Linear
from ...layers.modulation import GatedResidual, LayerNormScaleShift, ScaleResidualLayerNormScaleShift
from ...layers.norms import RMSNorm
from ...layers.rope import QKNormRope, RopeTables, into
from ...patches import Patch, PatchGroup, attention_kernel, set_on
from .transformer import (JointAttention, QwenImageTransformer, RotaryEmbedding, TIMESTEP_CHANNELS,
                          TimestepEmbedding, rope_positions)


# -- RMSNorm -------------------------------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers' RMSNorm: the variance in fp32, `x·rsqrt` promoted to fp32, ROUNDED to the weight dtype,
    then multiplied by the weight in that dtype (a second rounding)."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    return y * weight


# -- adaLN modulation (bf16 semantics: every elementwise op rounds) ----------------------------------------
def scale_shift_reference(xn, shift, scale) -> torch.Tensor:
    """diffusers' `QwenImageTransformerBlock._modulate`: `xn * (1 + scale) + shift`, each op rounded."""
    return xn * (1 + scale[:, None]) + shift[:, None]


def layer_norm_scale_shift_reference(x, shift, scale, eps: float) -> torch.Tensor:
    """nn.LayerNorm(elementwise_affine=False) on the bf16 input (fp32 inside, one rounding out), then
    `(1 + scale)`, `·`, `+ shift`, each rounded."""
    return scale_shift_reference(F.layer_norm(x, (x.shape[-1],), eps=eps), shift, scale)


def scale_residual_layer_norm_scale_shift_reference(residual, y, gate, shift, scale, eps: float):
    """`residual + gate·y` (two roundings) is the new residual; the norm reads that rounded value."""
    r = residual + gate[:, None] * y
    return r, layer_norm_scale_shift_reference(r, shift, scale, eps)


def gated_residual_reference(y, gate, residual) -> torch.Tensor:
    """diffusers' `hidden_states + gate.unsqueeze(1) * output` (the product rounded, then the sum; the product
    commutes exactly)."""
    return residual + y * gate[:, None]


# -- qk-norm + RoPE ------------------------------------------------------------------------------------------
_TABLE_ROWS = 4096  # diffusers precomputes 4096 positive and 4096 negative positions per axis


@functools.lru_cache(maxsize=8)
def _polar_tables(axes_dim: tuple[int, ...], theta: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-axis complex tables for positions 0..4095 and -4096..-1, built as diffusers' QwenEmbedRope builds
    them: on the CPU, `outer(index, 1/theta^(arange(0,d,2)/d))` then `torch.polar`."""

    def rope_params(index: torch.Tensor, dim: int) -> torch.Tensor:
        freqs = torch.outer(index, 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim)))
        return torch.polar(torch.ones_like(freqs), freqs)

    pos_index = torch.arange(_TABLE_ROWS)
    neg_index = torch.arange(_TABLE_ROWS).flip(0) * -1 - 1
    return [rope_params(pos_index, d) for d in axes_dim], [rope_params(neg_index, d) for d in axes_dim]


def rope_tables_reference(positions: torch.Tensor, axes_dim, theta, device) -> RopeTables:
    """Rows of the CPU-built polar tables for the given positions, then moved to the device."""
    pos, neg = _polar_tables(tuple(axes_dim), int(theta))
    cols = []
    for axis in range(len(axes_dim)):
        p = positions[:, axis]
        cols.append(torch.where((p >= 0)[:, None], pos[axis][p.clamp(min=0)],
                                neg[axis][(_TABLE_ROWS + p).clamp(max=_TABLE_ROWS - 1)]))
    return RopeTables(freqs=torch.cat(cols, dim=-1).to(device))


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, tables: RopeTables,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers: RMSNorm (rounded to bf16), then rotation as a complex multiplication in fp32, `.type_as(x)`
    (copied into `out`, a view of the joint attention buffer, if given: the values of diffusers' torch.cat)."""
    x = rms_norm_reference(x, weight, eps)
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    assert tables.freqs is not None  # the complex tables (`rope_tables_reference`)
    return into(torch.view_as_real(x_c * tables.freqs.unsqueeze(1)).flatten(3).type_as(x), out)


# -- the exact functions the group installs: Triton kernels on CUDA, the reference elsewhere -------------------------
def rms_norm_exact(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if kernels.use_eager_exact(x, weight) and x.dim() in (3, 4):
        return kernels.ops().rms_norm_eager_bf16(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def scale_shift_exact(xn, shift, scale) -> torch.Tensor:
    """The modulation's three roundings in one kernel."""
    if kernels.use_eager_exact(xn, shift, scale):
        return kernels.ops().scale_shift_eager_bf16(xn, shift, scale)
    return scale_shift_reference(xn, shift, scale)


def layer_norm_scale_shift_exact(x, shift, scale, eps: float) -> torch.Tensor:
    """PyTorch's LayerNorm itself (a reduction), then the modulation (`scale_shift_exact`)."""
    return scale_shift_exact(F.layer_norm(x, (x.shape[-1],), eps=eps), shift, scale)


def gated_residual_exact(y, gate, residual) -> torch.Tensor:
    """The eager mul-add kernel `c + a·(k+b)` with k = 0, which rounds the product, then the sum."""
    if kernels.use_eager_exact(y, gate, residual):
        return kernels.ops().mul_add_eager_bf16(y, gate, residual, 0.0)
    return gated_residual_reference(y, gate, residual)


def scale_residual_layer_norm_scale_shift_exact(residual, y, gate, shift, scale, eps: float):
    """`residual + gate·y` is the gated residual; the norm reads the rounded sum."""
    r = gated_residual_exact(y, gate, residual)
    return r, layer_norm_scale_shift_exact(r, shift, scale, eps)


_COMPLEX_FMA: dict[torch.device, bool | None] = {}  # device -> how its complex product rounds (None: no variant)


def complex_fma(device: torch.device) -> bool | None:
    """How PyTorch's complex multiplication rounds on `device`, found once by running it: True if it fuses a
    multiply-add as c10::complex compiled by nvcc does (re = fma(a, c, -b·d), im = fma(b, c, a·d)), False if it
    rounds every product (the CPU kernel); None if neither variant of the kernel reproduces the whole qk chain
    (the reference then runs, with a warning). The sample (786k elements) holds products where the two differ."""
    if device not in _COMPLEX_FMA:
        g = torch.Generator().manual_seed(101)
        S, D, axes = 64, 128, (16, 56, 56)
        x = (torch.randn(4, S, 24, D, generator=g) * 2).to(device, torch.bfloat16)
        w = (torch.randn(D, generator=g) * 0.1 + 1).to(device, torch.bfloat16)
        tables = rope_tables_reference(rope_positions(1, S, 0)[0], axes, 10000, device)
        _COMPLEX_FMA[device] = kernels.matching_variant(
            lambda fma: kernels.ops().rms_norm_eager_bf16(x, w, 1e-6, tables.freqs, complex_fma=fma),
            qk_norm_rope_reference(x, w, 1e-6, tables),
            f"no qk-norm + RoPE kernel variant reproduces PyTorch's complex multiplication on {device}: parity mode "
            f"runs that chain as eager ops (slower, still bitwise)")
    return _COMPLEX_FMA[device]


def qk_norm_rope_exact(x: torch.Tensor, weight: torch.Tensor, eps: float, tables: RopeTables,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """One kernel writes the normed, rotated heads straight into `out` (the joint buffer's rows) on CUDA, in the
    complex-product rounding `complex_fma` found on the device (found in the engine's eager warm-up forward: a CUDA
    graph capture that comes first records the reference)."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if kernels.use_eager_exact(x, weight) and (x.device in _COMPLEX_FMA or not capturing):
        fma = complex_fma(x.device)
        if fma is not None:
            return kernels.ops().rms_norm_eager_bf16(x, weight, eps, tables.freqs, out, complex_fma=fma)
    return qk_norm_rope_reference(x, weight, eps, tables, out)


# -- timestep ------------------------------------------------------------------------------------------------
def timestep_proj_reference(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pipeline passes `t.to(latent dtype) / 1000` (t rounded to bf16, then the quotient rounded again), and
    diffusers' Timesteps computes `1000 · (t·ω)` in fp32 (the product first, then the scale) and concatenates
    [cos, sin]."""
    t = t.to(dtype) / 1000
    half = TIMESTEP_CHANNELS // 2
    exponent = -math.log(10000) * torch.arange(start=0, end=half, dtype=torch.float32, device=t.device)
    exponent = exponent / (half - 0)
    emb = t[:, None].float() * torch.exp(exponent)[None, :]
    emb = 1000 * emb
    return torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1).to(dtype)


# -- the group -------------------------------------------------------------------------------------------------
def _qk_norm_rope(model: torch.nn.Module) -> None:
    set_on(RotaryEmbedding, "impl", rope_tables_reference)(model)
    set_on(QKNormRope, "impl", qk_norm_rope_exact)(model)


# The train side's diffusers attention backend -> the engine kernel whose forward is bitwise that backend's.
TRAIN_ATTENTION_KERNELS = {"_native_flash": "flash", "_native_cudnn": "cudnn"}
DEFAULT_TRAIN_ATTENTION_BACKEND = "_native_flash"


def make_group(train_attention_backend: str = DEFAULT_TRAIN_ATTENTION_BACKEND) -> PatchGroup:
    """The group for a train side that runs diffusers' attention backend `train_attention_backend`: the
    `attention_kernel` patch pins the kernel that backend runs; every other patch is the same."""
    kernel = attention_kernel(TRAIN_ATTENTION_KERNELS, train_attention_backend)
    return PatchGroup("qwen_image", (
        Patch("rms_norm", "RMSNorm rounds x·rsqrt to bf16 before the weight multiply",
              set_on(RMSNorm, "impl", rms_norm_exact)),
        Patch("layer_norm_scale_shift", "bf16 LayerNorm, then (1+scale), ·, +shift each rounded",
              set_on(LayerNormScaleShift, "impl", layer_norm_scale_shift_exact)),
        Patch("scale_residual_layer_norm_scale_shift",
              "residual + gate·y rounded twice; the norm reads the rounded residual",
              set_on(ScaleResidualLayerNormScaleShift, "impl", scale_residual_layer_norm_scale_shift_exact)),
        Patch("mul_add", "the gated residual c + a·b in eager bf16 (product, then sum) instead of one fp32 rounding",
              set_on(GatedResidual, "impl", gated_residual_exact)),
        Patch("qk_norm_rope", "qk-norm rounded to bf16, then complex-multiplication RoPE from diffusers-built tables",
              _qk_norm_rope),
        Patch("contiguous_split", "joint-attention output slices made contiguous before to_out/to_add_out",
              set_on(JointAttention, "contiguous_split", True)),
        Patch("unpacked_qkv", "separate q/k/v GEMMs with the bias in the same call",
              set_on(Linear, "unpacked", True)),
        Patch("timestep_dtype", "the timestep as the pipeline passes it, t.to(bf16)/1000, before the fp32 sinusoid",
              set_on(TimestepEmbedding, "proj_impl", timestep_proj_reference)),
        Patch("attention_kernel", f"the SDPA {kernel} kernel pinned, as the train side's `{train_attention_backend}` "
                                  f"backend runs it",
              set_on(JointAttention, "backend", kernel)),
        Patch("lora_unmerged", "LoRA updates stay unmerged, evaluated in PEFT's order: (W x + b) + scale·B(A x)",
              set_on(QwenImageTransformer, "lora_merge", False)),
    ))


GROUP = make_group()
