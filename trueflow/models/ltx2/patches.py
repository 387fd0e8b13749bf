"""The `ltx` rollout patch group: the engine's LTX-2.3 numerics made bitwise equal to the train side.

The train side is diffusers' `LTX2VideoTransformer3DModel` in bf16 without autocast, called with
`isolate_modalities=True` as the pipeline calls it otherwise. Every `*_reference` function here re-implements, op for
op, the arithmetic diffusers runs for the video stream, including each intermediate rounding to bf16; tests compare
each one with the diffusers function it mirrors (tests/test_ltx2_engine.py). Nothing is imported from diffusers.

Where a patch installs an `*_exact` function, it runs on CUDA in bf16 the eager-exact Triton kernels
(`kernels/triton_ops.py`, `*_eager_bf16`: every op rounded as the reference rounds it, the reductions left to the same
PyTorch calls), elsewhere (or with `TRUEFLOW_TRITON=0`) the reference itself; either way the bits are the
reference's (tests/test_kernels.py). The attention gate stays the reference on every device: its `sigmoid` is
CUDA's `expf`, which a kernel does not reproduce by construction.

What each patch changes, and why the engine's fast op differs:
- `rms_norm_scale_shift`: diffusers' `RMSNorm` (no weight) rounds `x·rsqrt(var+eps)` to bf16, then `(1+scale)`,
  `·` and `+shift` each round; the fast op keeps the chain in fp32 and rounds once.
- `text_kv_modulation`: the text's per-block key/value modulation `text·(1+scale)+shift`, three roundings in
  diffusers, one in the fast op.
- `gated_residual`: `residual + y·gate` rounds the product then the sum in diffusers; the fast op rounds once.
- `layer_norm_scale_shift`: the output `LayerNorm` rounds to bf16 before its three modulation ops, each rounded;
  the fast op is one fp32 chain.
- `attention_gate`: diffusers rounds `2·sigmoid(logits)` to bf16 before the product (and the product); the fast
  op rounds once.
- `qk_norm_rope`: `torch.nn.RMSNorm` (PyTorch's `rms_norm`) rounds to bf16, then the split RoPE reads that bf16
  value in fp32 (`addcmul_` as diffusers writes it) and rounds again; the fast op normalises, scales and rotates in
  fp32 with one rounding.
- `rope_tables`: diffusers builds the positions from pixel-space patch bounds (shift, clamp, `/fps`, midpoint,
  `/base size`) and the frequencies `θ^linspace` in float64 before rounding to fp32; the fast tables come from the
  closed-form positions and fp32 frequencies (no float64, which not every accelerator has).
- `unpacked_qkv`: one GEMM per projection (q, k, v, gate logits), each with its bias, instead of a packed GEMM.
- `text_mask_bias`: the pipeline passes an all-ones text mask, which the transformer turns into an additive bf16
  bias `(1-m)·-10000`, repeated per head, that attention reads; the fast engine passes no mask when every token is
  valid (a bool mask otherwise). A -10000 bias is not a -inf mask, and a kernel may be chosen by whether a mask is
  passed at all.
- `attention_kernel`: the kernel of the pairing pinned (below).
- `lora_unmerged`: LoRA kept unmerged, evaluated as PEFT does: `(W x + b) + (B(A x))·s`.

The attention pairing: the mask makes diffusers' `_native_flash` backend raise (it takes no mask), so the train side
runs a backend that takes the bias: `native` (the default pairing: PyTorch's SDPA chooses the kernel, and the
engine hands SDPA the same call: the same permuted q/k/v views and the same bias tensor, so it chooses the same one;
on the CPU that is SDPA's flash kernel, which takes a mask), `_native_math` (the math kernel pinned on both sides),
or `_native_efficient` (the memory-efficient kernel pinned; CUDA only).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from ... import kernels
from ...layers.linear import Linear
from ...layers.modulation import (AttentionGate, GatedResidual, LayerNormScaleShift, RMSNormScaleShift, ScaleShift,
                                  kernel_rows)
from ...layers.rope import QKNormAcrossHeadsRope, RopeTables
from ...patches import Patch, PatchGroup, attention_kernel, set_on
from .transformer import CrossAttention, LTX2Config, LTX2Transformer, RotaryEmbedding, SelfAttention, split_tables


# -- norms and modulation (bf16 semantics: every elementwise op rounds) ---------------------------------------
def rms_norm_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers' `RMSNorm` without a weight: the variance in fp32, `x·rsqrt` promoted to fp32, rounded to x's
    dtype."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_scale_shift_reference(x, shift, scale, eps: float) -> torch.Tensor:
    """The block's `norm(x) * (1 + scale) + shift`, each op rounded; without scale, the bare norm."""
    y = rms_norm_reference(x, eps)
    return y if scale is None else y * (1 + scale) + shift


def scale_shift_reference(x, shift, scale) -> torch.Tensor:
    """`encoder_hidden_states * (1 + scale_text_kv) + shift_text_kv`, each op rounded."""
    return x * (1 + scale) + shift


def gated_residual_reference(y, gate, residual) -> torch.Tensor:
    """`hidden_states + attn_hidden_states * gate` (the product rounded, then the sum)."""
    return residual + y * gate


def layer_norm_scale_shift_reference(x, shift, scale, eps: float) -> torch.Tensor:
    """`nn.LayerNorm(elementwise_affine=False)` on the bf16 input (fp32 inside, one rounding out), then
    `* (1 + scale) + shift`, each op rounded."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift


def attention_gate_reference(out, logits) -> torch.Tensor:
    """`gates = 2.0 * torch.sigmoid(gate_logits)` in bf16, then `hidden_states * gates.unsqueeze(-1)`."""
    return out * (2.0 * torch.sigmoid(logits)).unsqueeze(-1)


# -- qk-norm + split RoPE ----------------------------------------------------------------------------------------
def split_rope_reference(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """diffusers' `apply_split_rotary_emb` on x [B, S, H·D] with tables [1, H, S, D/2]: heads-major layout, each
    head's halves (first, second) in fp32, `out = x·cos`, then `first_out -= sin·second` and `second_out +=
    sin·first` with `addcmul_`, rounded to x's dtype."""
    cos, sin = tables.cos, tables.sin
    assert cos is not None and sin is not None, "the split RoPE's tables are real"
    B, S, _ = x.shape
    H = cos.shape[1]
    xh = x.reshape(B, S, H, -1).swapaxes(1, 2)
    r = xh.shape[-1] // 2
    split_x = xh.reshape(*xh.shape[:-1], 2, r).float()
    first_x, second_x = split_x[..., :1, :], split_x[..., 1:, :]
    cos_u, sin_u = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = split_x * cos_u
    out[..., :1, :].addcmul_(-sin_u, second_x)
    out[..., 1:, :].addcmul_(sin_u, first_x)
    out = out.reshape(*out.shape[:-2], 2 * r).swapaxes(1, 2).reshape(B, S, -1)
    return out.to(x.dtype)


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int,
                           tables: RopeTables | None) -> torch.Tensor:
    """diffusers' `torch.nn.RMSNorm(H·D)`: PyTorch's own `rms_norm` (a reduction, so its own call; rounded to bf16
    once), then the split RoPE from that bf16 value if tables are given. Returns [B, S, H, D]."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    if tables is not None:
        y = split_rope_reference(y, tables)
    return y.unflatten(-1, (heads, -1))


def rope_tables_reference(config: LTX2Config, grid: tuple[int, int, int], fps: float, device) -> RopeTables:
    """`LTX2AudioVideoRotaryPosEmbed.prepare_video_coords` then its forward, for one sample (the tables are the same
    for every sample): pixel-space patch bounds [start, end) per axis (the frame axis shifted by the causal offset,
    clamped at 0 and divided by fps), their midpoint over the base sizes, and the frequencies
    `θ^linspace(0, 1, n)` in float64 (`rope_double_precision`), times π/2, rounded to fp32."""
    frames, rows, cols = grid
    axes = [torch.arange(0, n, 1, dtype=torch.float32, device=device) for n in (frames, rows, cols)]
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # [3, F, H, W]
    ends = coords + torch.tensor((1, 1, 1), dtype=coords.dtype, device=device).view(3, 1, 1, 1)
    latent = torch.stack([coords, ends], dim=-1).flatten(1, 3).unsqueeze(0)  # [1, 3, S, 2]
    pixel = latent * torch.tensor(config.vae_scale_factors, device=device).view(1, -1, 1, 1)
    pixel[:, 0, ...] = (pixel[:, 0, ...] + config.causal_offset - config.vae_scale_factors[0]).clamp(min=0)
    pixel[:, 0, ...] = pixel[:, 0, ...] / fps
    start, end = pixel.chunk(2, dim=-1)
    mid = ((start + end) / 2.0).squeeze(-1)  # [1, 3, S]
    max_positions = (config.pos_embed_max_pos, config.base_height, config.base_width)
    pos = torch.stack([mid[:, i] / max_positions[i] for i in range(3)], dim=-1)  # [1, S, 3]
    freqs_dtype = torch.float64 if config.rope_double_precision else torch.float32
    pow_indices = torch.pow(config.rope_theta, torch.linspace(start=0.0, end=1.0, steps=config.inner_dim // 6,
                                                              dtype=freqs_dtype, device=device))
    freqs = (pow_indices * torch.pi / 2.0).to(dtype=torch.float32)
    angles = ((pos.unsqueeze(-1) * 2 - 1) * freqs).transpose(-1, -2).flatten(2)  # [1, S, 3n]
    return split_tables(angles[0], config.inner_dim, config.num_attention_heads)


# -- the exact functions the group installs: Triton kernels on CUDA, the reference elsewhere -------------------------
def rms_norm_scale_shift_exact(x, shift, scale, eps: float) -> torch.Tensor:
    """The squares and the modulated norm in kernels, the variance PyTorch's own mean; the bare norm stays the
    reference."""
    if scale is not None and kernels.use_eager_exact(x, shift, scale) and kernel_rows(x, shift, scale):
        return kernels.ops().rms_norm_scale_shift_eager_bf16(x, shift, scale, eps)
    return rms_norm_scale_shift_reference(x, shift, scale, eps)


def scale_shift_exact(x, shift, scale) -> torch.Tensor:
    if kernels.use_eager_exact(x, shift, scale) and kernel_rows(x, shift, scale):
        return kernels.ops().scale_shift_eager_bf16(x, shift, scale)
    return scale_shift_reference(x, shift, scale)


def gated_residual_exact(y, gate, residual) -> torch.Tensor:
    """The eager mul-add kernel `c + a·(k+b)` with k = 0: the product rounded, then the sum."""
    if kernels.use_eager_exact(y, gate, residual) and kernel_rows(y, gate):
        return kernels.ops().mul_add_eager_bf16(y, gate, residual, 0.0)
    return gated_residual_reference(y, gate, residual)


def layer_norm_scale_shift_exact(x, shift, scale, eps: float) -> torch.Tensor:
    """PyTorch's LayerNorm itself (a reduction), then the modulation's three roundings in one kernel."""
    if kernels.use_eager_exact(x, shift, scale) and kernel_rows(x, shift, scale):
        return kernels.ops().scale_shift_eager_bf16(F.layer_norm(x, (x.shape[-1],), eps=eps), shift, scale)
    return layer_norm_scale_shift_reference(x, shift, scale, eps)


# The sample that tells the two roundings of `addcmul_` apart, by construction: with p = 2^-8 + 2^-24 + 2^-32 and
# q = p/3 = 5592491·2^-32 (exact in fp32), `1·1 + q·3` fused is 1 + p, which rounds to fp32 1 + 2^-8 + 2^-23 and then
# up to bf16 1 + 2^-7; with the product rounded first (q·3 -> 2^-8 + 2^-24, a tie to even), 1 + 2^-8 + 2^-24 is an
# fp32 tie that goes to 1 + 2^-8, a bf16 tie that goes to 1. Head 0 has it in its first half (a = 1, b = 3, sin = -q),
# head 1 in its second (a = 3, b = 1, sin = q); the real head width (D = 128) keeps PyTorch's vectorised CPU loop.
_FMA_Q = 5592491 * 2.0**-32
_SPLIT_FMA: dict[torch.device, bool | None] = {}  # device -> how its addcmul_ rounds (None: no kernel variant)


def split_rope_fma_sample(device) -> tuple[torch.Tensor, RopeTables]:
    """(y [1, 1, 2·128] bf16, per-head tables [1, 2, 1, 64]): the discriminating sample above."""
    half = torch.ones(64)
    y = torch.cat([half, 3 * half, 3 * half, half]).view(1, 1, 256).to(device, torch.bfloat16)
    cos = torch.ones(1, 2, 1, 64, device=device)
    sin = torch.tensor([-_FMA_Q, _FMA_Q], device=device).view(1, 2, 1, 1).expand(1, 2, 1, 64).contiguous()
    return y, RopeTables(cos=cos, sin=sin, pairs="split")


def split_rope_fma(device: torch.device) -> bool | None:
    """How PyTorch's `addcmul_` rounds on `device`, found once by running diffusers' split RoPE on a sample that tells
    the two apart (`split_rope_fma_sample`): True if it fuses the product into the sum, False if it rounds the product
    first; None if neither kernel variant reproduces it (the reference then runs, with a warning)."""
    if device not in _SPLIT_FMA:
        y, tables = split_rope_fma_sample(device)
        _SPLIT_FMA[device] = kernels.matching_variant(
            lambda fma: kernels.ops().split_rope_eager_bf16(y, tables.cos, tables.sin, fma),
            split_rope_reference(y, tables),
            f"no split-RoPE kernel variant reproduces PyTorch's addcmul_ on {device}: parity mode runs that chain as "
            f"eager ops (slower, still bitwise)")
    return _SPLIT_FMA[device]


def qk_norm_rope_exact(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int,
                       tables: RopeTables | None) -> torch.Tensor:
    """PyTorch's `rms_norm` itself (a reduction), then the split RoPE in one kernel in the `addcmul_` rounding
    `split_rope_fma` found on the device (found in the engine's eager warm-up forward: a CUDA graph capture that
    comes first runs the reference)."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    if tables is not None:
        capturing = y.is_cuda and torch.cuda.is_current_stream_capturing()
        fma = split_rope_fma(y.device) if kernels.use_eager_exact(y) and tables.cos is not None and \
            tables.cos.dim() == 4 and (y.device in _SPLIT_FMA or not capturing) else None
        assert tables.cos is not None and tables.sin is not None, "the split RoPE's tables are real"
        y = split_rope_reference(y, tables) if fma is None else \
            kernels.ops().split_rope_eager_bf16(y, tables.cos, tables.sin, fma)
    return y.unflatten(-1, (heads, -1))


# -- the group -------------------------------------------------------------------------------------------------
# The train side's diffusers attention backend -> the engine kernel whose forward is bitwise that backend's.
TRAIN_ATTENTION_KERNELS = {"native": "sdpa", "_native_math": "math", "_native_efficient": "efficient"}
DEFAULT_TRAIN_ATTENTION_BACKEND = "native"


def make_group(train_attention_backend: str = DEFAULT_TRAIN_ATTENTION_BACKEND) -> PatchGroup:
    """The group for a train side that runs diffusers' attention backend `train_attention_backend`: the
    `attention_kernel` patch pins the kernel that backend runs; every other patch is the same."""
    kernel = attention_kernel(TRAIN_ATTENTION_KERNELS, train_attention_backend, " with LTX-2's text mask")
    return PatchGroup("ltx", (
        Patch("rms_norm_scale_shift", "RMSNorm rounded to bf16, then (1+scale), ·, +shift each rounded",
              set_on(RMSNormScaleShift, "impl", rms_norm_scale_shift_exact)),
        Patch("text_kv_modulation", "the text's per-block key/value modulation, (1+scale), ·, +shift each rounded",
              set_on(ScaleShift, "impl", scale_shift_exact)),
        Patch("gated_residual", "residual + y·gate with the product and the sum each rounded",
              set_on(GatedResidual, "impl", gated_residual_exact)),
        Patch("layer_norm_scale_shift", "output LayerNorm rounded to bf16, then (1+scale), ·, +shift each rounded",
              set_on(LayerNormScaleShift, "impl", layer_norm_scale_shift_exact)),
        Patch("attention_gate", "2·sigmoid(logits) rounded to bf16 before the per-head product",
              set_on(AttentionGate, "impl", attention_gate_reference)),
        Patch("qk_norm_rope", "qk RMSNorm rounded to bf16, then split RoPE in fp32 with addcmul_, rounded",
              set_on(QKNormAcrossHeadsRope, "impl", qk_norm_rope_exact)),
        Patch("rope_tables", "RoPE tables from pixel-space patch bounds and float64 frequencies, as diffusers",
              set_on(RotaryEmbedding, "impl", rope_tables_reference)),
        Patch("unpacked_qkv", "separate q/k/v/gate GEMMs with the bias in the same call",
              set_on(Linear, "unpacked", True)),
        Patch("text_mask_bias", "the text mask as the pipeline's additive bf16 bias (1-m)·-10000 per head, "
                                "all ones when none is given",
              set_on(LTX2Transformer, "text_mask_bias", True)),
        Patch("attention_kernel", f"the SDPA kernel of the train side's `{train_attention_backend}` backend "
                                  f"({'chosen by SDPA on the same call' if kernel == 'sdpa' else kernel + ' pinned'})",
              set_on((SelfAttention, CrossAttention), "backend", kernel)),
        Patch("lora_unmerged", "LoRA updates stay unmerged, evaluated in PEFT's order: (W x + b) + scale·B(A x)",
              set_on(LTX2Transformer, "lora_merge", False)),
    ))


GROUP = make_group()
