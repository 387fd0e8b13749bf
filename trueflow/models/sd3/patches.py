"""The `sd3` rollout patch group: the engine's SD3 / SD3.5 numerics made bitwise equal to the train side.

The train side is diffusers' `SD3Transformer2DModel` in bf16 without autocast, called as `StableDiffusion3Pipeline`
calls it. Every `*_reference` function here re-implements, op for op, the arithmetic diffusers runs, including each
intermediate rounding to bf16; tests compare each one with the diffusers function it mirrors
(tests/test_sd3_engine.py). Nothing is imported from diffusers.

What each patch changes, and why the engine's fast op differs:
- `layer_norm_scale_shift`: adaLN-Zero's and adaLN-Continuous' `LN(x)·(1+scale)+shift`: diffusers' `nn.LayerNorm` on
  bf16 (fp32 inside, one rounding), then `1+scale`, `·`, `+shift` each rounded; the fast op rounds once.
- `scale_residual_layer_norm_scale_shift`: `h + gate·attn` (the product, then the sum, rounded) and the MLP norm of
  that rounded residual; the fast op keeps the residual in fp32 for the norm.
- `mul_add`: the remaining gated residuals (after the MLPs, and MMDiT-X's second attention), eager bf16.
- `qk_norm`: diffusers' per-head `RMSNorm` rounds `x·rsqrt(var+eps)` to bf16 before the weight multiply, on the
  heads-major view `[B, H, S, D]` it is handed; the fast op normalises and scales in fp32 with one rounding.
- `conv_patch_embed`: the patch embedding as diffusers' `Conv2d` (kernel = stride = 2) on the contiguous `[B, C, h,
  w]` latents; the fast op is one GEMM on the packed patches, which reduces in another order.
- `strided_split`: diffusers hands `to_out` / `to_add_out` strided slices of the joint `[B, S+L, H·D]` output; the
  fast engine gives each stream contiguous rows. At batch > 1 the strided GEMM takes another kernel.
- `unpacked_qkv`: one GEMM per projection (q, k, v), each with its bias, instead of a packed GEMM.
- `attention_layout`: diffusers' `torch.cat` of the streams' `[B, H, S, D]` q/k/v makes contiguous heads-major
  tensors, which SDPA gets; the fast engine hands it token-major views. (The second, image-only attention gets the
  token-major views in diffusers too, so it keeps them.)
- `lora_unmerged`: LoRA kept unmerged, evaluated as PEFT does: `(W x + b) + (B(A x))·s`.

No timestep patch: the pipeline passes the fp32 schedule timestep itself, whose sinusoid the engine already computes
as diffusers' `Timesteps` does. The attention pairing: `JointAttnProcessor2_0` calls `F.scaled_dot_product_attention`
itself (diffusers' attention dispatch, and so its backends, never reach it), so the train side always runs SDPA's own
choice, and the engine hands SDPA the same call (`native`, the only pairing).

What the patches install are the `*_exact` functions: on CUDA in bf16 the norm modulation and the gated residuals run
the eager-exact Triton kernels (`kernels/triton_ops.py`, `*_eager_bf16`: the same kernels, on the same op sequences,
as the `qwen_image` group's), after PyTorch's own LayerNorm; elsewhere, or with `TRUEFLOW_TRITON=0`, the reference
itself. Either way the bits are the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import kernels
from ...layers.linear import Linear
from ...layers.modulation import GatedResidual, LayerNormScaleShift, ScaleResidualLayerNormScaleShift
from ...layers.rope import QKNormRope, RopeTables, into
from ...patches import Patch, PatchGroup, set_on
from .transformer import JointAttention, PatchEmbed, SD3Transformer, conv_input


# -- adaLN modulation and gated residuals (bf16 semantics: every elementwise op rounds) ------------------------------
def layer_norm_scale_shift_reference(x, shift, scale, eps: float) -> torch.Tensor:
    """`AdaLayerNormZero`'s `self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]` (and the block's MLP norm,
    `AdaLayerNormContinuous`'s `(1 + scale)[:, None, :]`, the same ops): `nn.LayerNorm(elementwise_affine=False)` on
    the bf16 input, then `1 + scale`, `·`, `+ shift`, each rounded."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]


def gated_residual_reference(y, gate, residual) -> torch.Tensor:
    """`JointTransformerBlock`'s `hidden_states + gate.unsqueeze(1) * output` (the product rounded, then the sum)."""
    return residual + gate[:, None] * y


def scale_residual_layer_norm_scale_shift_reference(residual, y, gate, shift, scale, eps: float):
    """`h = h + gate_msa.unsqueeze(1) * attn_output`, then the MLP's `norm2(h) * (1 + scale_mlp[:, None]) +
    shift_mlp[:, None]` on that rounded residual."""
    r = gated_residual_reference(y, gate, residual)
    return r, layer_norm_scale_shift_reference(r, shift, scale, eps)


def layer_norm_scale_shift_exact(x, shift, scale, eps: float) -> torch.Tensor:
    """PyTorch's LayerNorm itself (a reduction), then the modulation's three roundings in one kernel."""
    if kernels.use_eager_exact(x, shift, scale):
        return kernels.ops().scale_shift_eager_bf16(F.layer_norm(x, (x.shape[-1],), eps=eps), shift, scale)
    return layer_norm_scale_shift_reference(x, shift, scale, eps)


def gated_residual_exact(y, gate, residual) -> torch.Tensor:
    """The eager mul-add kernel `c + a·(k+b)` with k = 0: the product rounded, then the sum (the product commutes
    exactly)."""
    if kernels.use_eager_exact(y, gate, residual):
        return kernels.ops().mul_add_eager_bf16(y, gate, residual, 0.0)
    return gated_residual_reference(y, gate, residual)


def scale_residual_layer_norm_scale_shift_exact(residual, y, gate, shift, scale, eps: float):
    r = gated_residual_exact(y, gate, residual)
    return r, layer_norm_scale_shift_exact(r, shift, scale, eps)


# -- q/k RMSNorm ---------------------------------------------------------------------------------------------------
def qk_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, tables: RopeTables | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' `RMSNorm(head_dim)` on q or k as `JointAttnProcessor2_0` hands it: the heads-major view
    `x.transpose(1, 2)` of the projection's `[B, S, H, D]` (so its reductions read the tensor diffusers reads), the
    variance in fp32, `x·rsqrt` promoted to fp32 and ROUNDED to the weight dtype, then `· weight` in that dtype.
    Returned token-major (a view of the heads-major result), or copied into `out`. SD3 has no RoPE: `tables` is None."""
    if tables is not None:
        raise ValueError("SD3's q/k norm takes no rotary tables")
    xt = x.transpose(1, 2)
    variance = xt.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = xt * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    return into((y * weight).transpose(1, 2), out)


# -- patch embedding ---------------------------------------------------------------------------------------------
def patch_embed_reference(tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grid: tuple[int, int],
                          pos: torch.Tensor) -> torch.Tensor:
    """diffusers' `PatchEmbed.forward` with `pos_embed_max_size`: `proj` (`F.conv2d`, kernel = stride = patch) on the
    contiguous `[B, C, h, w]` latents, `flatten(2).transpose(1, 2)`, `(latent + pos_embed).to(latent.dtype)`, then the
    transformer's `.contiguous()`."""
    latent = F.conv2d(conv_input(tokens, grid), weight, bias, stride=weight.shape[-1])
    latent = latent.flatten(2).transpose(1, 2)
    return (latent + pos).to(latent.dtype).contiguous()


# -- the group -------------------------------------------------------------------------------------------------
# The train side's diffusers attention backend -> the engine kernel whose forward is bitwise that backend's. SD3's
# processor calls SDPA itself, so diffusers' backend setting never reaches it: SDPA's own choice, `native`.
TRAIN_ATTENTION_KERNELS = {"native": "sdpa"}
DEFAULT_TRAIN_ATTENTION_BACKEND = "native"
JOINT_KERNEL = "sdpa_heads_major"  # SDPA's choice on contiguous heads-major q/k/v: the torch.cat'ed joint tensors


def make_group(train_attention_backend: str = DEFAULT_TRAIN_ATTENTION_BACKEND) -> PatchGroup:
    """The group for the train side's attention backend; SD3 has one pairing (`native`), see the module docstring."""
    if train_attention_backend not in TRAIN_ATTENTION_KERNELS:
        raise ValueError(f"SD3's attention processor calls PyTorch's SDPA itself, so the train backend "
                         f"{train_attention_backend!r} never reaches it; use {DEFAULT_TRAIN_ATTENTION_BACKEND}")
    return PatchGroup("sd3", (
        Patch("layer_norm_scale_shift", "bf16 LayerNorm, then (1+scale), ·, +shift each rounded",
              set_on(LayerNormScaleShift, "impl", layer_norm_scale_shift_exact)),
        Patch("scale_residual_layer_norm_scale_shift",
              "residual + gate·y rounded twice; the MLP norm reads the rounded residual",
              set_on(ScaleResidualLayerNormScaleShift, "impl", scale_residual_layer_norm_scale_shift_exact)),
        Patch("mul_add", "the gated residuals c + a·b in eager bf16 (product, then sum) instead of one fp32 rounding",
              set_on(GatedResidual, "impl", gated_residual_exact)),
        Patch("qk_norm", "per-head q/k RMSNorm rounded to bf16 before the weight, on diffusers' heads-major view",
              set_on(QKNormRope, "impl", qk_norm_reference)),
        Patch("conv_patch_embed", "the patch embedding as diffusers' Conv2d on the unpacked latents, not a GEMM on "
                                  "packed patches",
              set_on(PatchEmbed, "impl", patch_embed_reference)),
        Patch("strided_split", "to_out/to_add_out read strided slices of the joint attention output, as diffusers",
              set_on(JointAttention, "strided_split", True)),
        Patch("unpacked_qkv", "separate q/k/v GEMMs with the bias in the same call",
              set_on(Linear, "unpacked", True)),
        Patch("attention_layout", "the joint attention's q/k/v contiguous heads-major, as diffusers' torch.cat makes "
                                  "them, for SDPA's own kernel choice",
              set_on(JointAttention, "backend", JOINT_KERNEL)),
        Patch("lora_unmerged", "LoRA updates stay unmerged, evaluated in PEFT's order: (W x + b) + scale·B(A x)",
              set_on(SD3Transformer, "lora_merge", False)),
    ))


GROUP = make_group()
