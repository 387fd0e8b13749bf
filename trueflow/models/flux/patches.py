"""The `flux` rollout patch group: the engine's FLUX.1 numerics made bitwise equal to the train side.

The train side is diffusers' `FluxTransformer2DModel` in bf16 without autocast, called as `FluxPipeline.__call__`
calls it. Every `*_reference` function here re-implements, op for op, the arithmetic diffusers runs (diffusers 0.42.1,
`models/transformers/transformer_flux.py`, `models/normalization.py`, `models/embeddings.py`), including each
intermediate rounding to bf16; tests compare each one with the diffusers function it mirrors
(tests/test_flux_engine.py). Nothing is imported from diffusers.

What each patch changes, and why the engine's fast op differs:
- `layer_norm_scale_shift`: `AdaLayerNormZero(Single)` and `AdaLayerNormContinuous` run `nn.LayerNorm` on the bf16
  input (one rounding), then `(1 + scale)`, `·` and `+ shift`, each rounded; the fast op is one fp32 chain.
- `scale_residual_layer_norm_scale_shift`: a double-stream block's `hidden + gate·attn` (two roundings) is the new
  residual, and `norm2` reads that rounded value; the fast op keeps the sum in fp32 for the norm.
- `gated_residual`: `hidden + gate·ff` (and the single-stream block's `residual + gate·proj_out(...)`) rounds the
  product, then the sum; the fast op rounds once.
- `qk_norm_rope`: the q/k norms are PyTorch's `nn.RMSNorm` (one call, rounded to bf16), then `apply_rotary_emb`
  rotates that bf16 value in fp32 with real cos/sin (`x·cos + rot(x)·sin`) and rounds again; the fast op
  normalises, scales and rotates in fp32 with one rounding.
- `rope_tables`: `FluxPosEmbed` builds its angles in float64 on the position ids' device, from ids in the latent
  dtype, and rounds cos/sin to fp32; the fast tables are fp32 angles from integer positions (no float64, which not
  every accelerator has: a table built another way differed ~2e-2 in one framework).
- `contiguous_split`: the joint attention's output slices are made contiguous before `to_out` / `to_add_out`, as
  diffusers' processor does (a strided slice fed to a GEMM can take another kernel at batch > 1).
- `unpacked_qkv`: one GEMM per projection (q, k, v; in a single-stream block also the MLP's input projection), each
  with its bias in the call, instead of one packed GEMM.
- `timestep_dtype`: the pipeline passes `t.to(bf16) / 1000` and the model multiplies it by 1000 in bf16 (the
  guidance scale likewise: `guidance.to(bf16) · 1000`) before the fp32 sinusoid; the fast path takes the sinusoid of
  the fp32 values.
- `attention_kernel`: the kernel of the train side's backend pinned (`_native_flash` by default).
- `lora_unmerged`: LoRA kept unmerged, evaluated as PEFT does: `(W x + b) + (B(A x))·s`.

On CUDA in bf16 the modulation and residual patches run the eager-exact Triton kernels (`kernels/triton_ops.py`,
`*_eager_bf16`: every op rounded as the reference rounds it, the LayerNorm left to PyTorch's own call), elsewhere (or
with `TRUEFLOW_TRITON=0`) the reference itself; either way the bits are the reference's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ... import kernels
from ...layers.linear import Linear
from ...layers.modulation import GatedResidual, LayerNormScaleShift, ScaleResidualLayerNormScaleShift
from ...layers.rope import QKNormRope, RopeTables, into
from ...layers.timestep import TIMESTEP_CHANNELS
from ...patches import Patch, PatchGroup, attention_kernel, set_on
from .transformer import (ROPE_THETA, FluxTransformer, JointAttention, RotaryEmbedding, SelfAttention,
                          TimeGuidanceTextEmbedding)


# -- adaLN modulation and gated residuals (bf16 semantics: every elementwise op rounds) -----------------------------
def layer_norm_scale_shift_reference(x, shift, scale, eps: float) -> torch.Tensor:
    """`nn.LayerNorm(elementwise_affine=False)` on the bf16 input (fp32 inside, one rounding out), then
    `* (1 + scale[:, None]) + shift[:, None]`, each op rounded (`AdaLayerNormZero.forward`)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]


def gated_residual_reference(y, gate, residual) -> torch.Tensor:
    """`hidden_states + gate.unsqueeze(1) * y`: the product rounded, then the sum."""
    return residual + gate.unsqueeze(1) * y


def scale_residual_layer_norm_scale_shift_reference(residual, y, gate, shift, scale, eps: float):
    """`FluxTransformerBlock.forward`: `hidden_states + gate_msa.unsqueeze(1) * attn_output` is the new residual;
    `norm2` reads that rounded value, then the modulation."""
    r = gated_residual_reference(y, gate, residual)
    return r, layer_norm_scale_shift_reference(r, shift, scale, eps)


def _exact_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the eager-exact kernels run (`kernels.use_eager_exact`) on these [B, D] modulation rows."""
    return kernels.use_eager_exact(*tensors) and all(t.dim() == 2 for t in tensors[1:])


def layer_norm_scale_shift_exact(x, shift, scale, eps: float) -> torch.Tensor:
    """PyTorch's LayerNorm itself (a reduction), then the modulation's three roundings in one kernel."""
    if _exact_kernels(x, shift, scale):
        return kernels.ops().scale_shift_eager_bf16(F.layer_norm(x, (x.shape[-1],), eps=eps), shift, scale)
    return layer_norm_scale_shift_reference(x, shift, scale, eps)


def gated_residual_exact(y, gate, residual) -> torch.Tensor:
    """The eager mul-add kernel `c + a·(k+b)` with k = 0: the product rounded, then the sum."""
    if _exact_kernels(y, gate):
        return kernels.ops().mul_add_eager_bf16(y, gate, residual, 0.0)
    return gated_residual_reference(y, gate, residual)


def scale_residual_layer_norm_scale_shift_exact(residual, y, gate, shift, scale, eps: float):
    r = gated_residual_exact(y, gate, residual)
    return r, layer_norm_scale_shift_exact(r, shift, scale, eps)


# -- qk-norm + RoPE ------------------------------------------------------------------------------------------
def rope_reference(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """`apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1, sequence_dim=1)` on x [B, S, H, D]:
    cos/sin repeated pairwise to [S, D] (as `get_1d_rotary_pos_embed(repeat_interleave_real=True)` returns them),
    the pairs rotated as `(-x_imag, x_real)`, then `x.float()·cos + x_rotated.float()·sin`, rounded to x's dtype."""
    assert tables.cos is not None and tables.sin is not None  # the real tables
    cos = tables.cos.repeat_interleave(2, dim=-1)[None, :, None, :]
    sin = tables.sin.repeat_interleave(2, dim=-1)[None, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, tables: RopeTables | None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """`FluxAttention.norm_q` (`torch.nn.RMSNorm(head_dim)`: PyTorch's `rms_norm`, its own call, rounded to bf16),
    then the rotation of that bf16 value (copied into `out`, a view of the joint buffer, if given: the values of
    diffusers' torch.cat, which it rotates whole)."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return into(y if tables is None else rope_reference(y, tables), out)


def rope_tables_reference(grid: tuple[int, int], text_len: int, axes_dim: tuple[int, ...], device,
                          dtype: torch.dtype) -> RopeTables:
    """`FluxPosEmbed.forward` on the ids FluxPipeline passes: `txt_ids` zeros [L, 3] and `img_ids` (0, row, col)
    made in fp32 on the CPU, both moved to the device in the latent `dtype` (`encode_prompt`,
    `_prepare_latent_image_ids`), concatenated; per axis `get_1d_rotary_pos_embed(use_real=True,
    freqs_dtype=float64)` on that device: `1 / theta^(arange(0, d, 2) / d)` in float64, the outer product with the
    ids `.float()`, cos and sin in float64 rounded to fp32. (float64 falls back to fp32 on mps, npu and neuron, as
    diffusers' `maybe_adjust_dtype_for_device` does.) Returned unrepeated, [L + S, D/2]."""
    device = torch.device(device)
    rows, cols = grid
    txt_ids = torch.zeros(text_len, 3).to(device=device, dtype=dtype)
    img_ids = torch.zeros(rows, cols, 3)
    img_ids[..., 1] = img_ids[..., 1] + torch.arange(rows)[:, None]
    img_ids[..., 2] = img_ids[..., 2] + torch.arange(cols)[None, :]
    img_ids = img_ids.reshape(rows * cols, 3).to(device=device, dtype=dtype)
    pos = torch.cat((txt_ids, img_ids), dim=0).float()
    freqs_dtype = torch.float32 if device.type in ("mps", "npu", "neuron") else torch.float64
    cos, sin = [], []
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / (float(ROPE_THETA) ** (torch.arange(0, dim, 2, dtype=freqs_dtype, device=device) / dim)) / 1.0
        freqs = torch.outer(pos[:, axis], freqs)
        cos.append(freqs.cos().float())
        sin.append(freqs.sin().float())
    return RopeTables(cos=torch.cat(cos, dim=-1).to(device), sin=torch.cat(sin, dim=-1).to(device))


# -- timestep and guidance ----------------------------------------------------------------------------------------
def _sinusoid_reference(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` (`get_timestep_embedding`, scale 1)
    on the model's bf16 value, then `.to(pooled_projection.dtype)`."""
    half = TIMESTEP_CHANNELS // 2
    exponent = -math.log(10000) * torch.arange(start=0, end=half, dtype=torch.float32, device=t.device)
    exponent = exponent / (half - 0)
    emb = t[:, None].float() * torch.exp(exponent)[None, :]
    emb = 1 * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1).to(dtype)


def timestep_proj_reference(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pipeline passes `t.expand(B).to(latents.dtype) / 1000` (t rounded, then the quotient rounded); the model
    takes `timestep.to(hidden_states.dtype) * 1000` (rounded again) before the sinusoid."""
    return _sinusoid_reference((t.to(dtype) / 1000).to(dtype) * 1000, dtype)


def guidance_proj_reference(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pipeline passes the fp32 scale itself (`torch.full([1], guidance_scale, dtype=torch.float32)`); the model
    takes `guidance.to(hidden_states.dtype) * 1000` (two roundings: 3.5 becomes 3504) before the sinusoid."""
    return _sinusoid_reference(g.to(dtype) * 1000, dtype)


# -- the group -------------------------------------------------------------------------------------------------
def _qk_norm_rope(model: torch.nn.Module) -> None:
    set_on(QKNormRope, "impl", qk_norm_rope_reference)(model)


def _timestep_dtype(model: torch.nn.Module) -> None:
    set_on(TimeGuidanceTextEmbedding, "timestep_impl", timestep_proj_reference)(model)
    set_on(TimeGuidanceTextEmbedding, "guidance_impl", guidance_proj_reference)(model)


# The train side's diffusers attention backend -> the engine kernel whose forward is bitwise that backend's.
TRAIN_ATTENTION_KERNELS = {"_native_flash": "flash", "_native_cudnn": "cudnn"}
DEFAULT_TRAIN_ATTENTION_BACKEND = "_native_flash"


def make_group(train_attention_backend: str = DEFAULT_TRAIN_ATTENTION_BACKEND) -> PatchGroup:
    """The group for a train side that runs diffusers' attention backend `train_attention_backend`: the
    `attention_kernel` patch pins the kernel that backend runs; every other patch is the same."""
    kernel = attention_kernel(TRAIN_ATTENTION_KERNELS, train_attention_backend)
    return PatchGroup("flux", (
        Patch("layer_norm_scale_shift", "bf16 LayerNorm, then (1+scale), ·, +shift each rounded",
              set_on(LayerNormScaleShift, "impl", layer_norm_scale_shift_exact)),
        Patch("scale_residual_layer_norm_scale_shift",
              "residual + gate·y rounded twice; the norm reads the rounded residual",
              set_on(ScaleResidualLayerNormScaleShift, "impl", scale_residual_layer_norm_scale_shift_exact)),
        Patch("gated_residual", "residual + gate·y with the product and the sum each rounded",
              set_on(GatedResidual, "impl", gated_residual_exact)),
        Patch("qk_norm_rope", "PyTorch's rms_norm rounded to bf16, then real cos/sin RoPE in fp32, rounded",
              _qk_norm_rope),
        Patch("rope_tables", "RoPE tables from the pipeline's bf16 position ids, float64 angles on the device",
              set_on(RotaryEmbedding, "impl", rope_tables_reference)),
        Patch("contiguous_split", "joint-attention output slices made contiguous before to_out/to_add_out",
              set_on(JointAttention, "contiguous_split", True)),
        Patch("unpacked_qkv", "separate q/k/v (and single-block MLP) GEMMs with the bias in the same call",
              set_on(Linear, "unpacked", True)),
        Patch("timestep_dtype", "timestep and guidance as the pipeline passes them and the model scales them in "
                                "bf16, before the fp32 sinusoid",
              _timestep_dtype),
        Patch("attention_kernel", f"the SDPA {kernel} kernel pinned, as the train side's `{train_attention_backend}` "
                                  f"backend runs it",
              set_on((JointAttention, SelfAttention), "backend", kernel)),
        Patch("lora_unmerged", "LoRA updates stay unmerged, evaluated in PEFT's order: (W x + b) + scale·B(A x)",
              set_on(FluxTransformer, "lora_merge", False)),
    ))


GROUP = make_group()
