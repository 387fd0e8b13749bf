"""The `wan` rollout patch group: the engine's Wan2.2 numerics made bitwise equal to the train side.

The train side is diffusers' `WanTransformer3DModel` as `from_pretrained(torch_dtype=bf16)` loads it (its
`_keep_in_fp32_modules` in fp32), without autocast. Every `*_reference` function here re-implements, op for op, the
arithmetic diffusers runs, including each intermediate rounding; tests compare each one with the diffusers code it
mirrors (tests/test_wan_engine.py). Nothing is imported from diffusers.

Wan's block already keeps its modulation in fp32 (`.float()` everywhere, fp32 tables), so unlike Qwen-Image's and
LTX-2.3's groups there is no bf16 chain to reproduce there; what differs is:
- `rope_tables`: diffusers builds the tables once, on the CPU, per axis in float64 (`get_1d_rotary_pos_embed`, then
  `.float()`), over positions 0..rope_max_seq_len; the fast tables are fp32 on the device.
- `qk_norm_rope`: `torch.nn.RMSNorm` across heads (PyTorch's `rms_norm`) rounds to bf16, then the RoPE reads that
  bf16 value against fp32 tables (`x1·cos − x2·sin`, `x1·sin + x2·cos`) and rounds again into an `empty_like` copy;
  the fast op normalises, scales and rotates in fp32 with one rounding.
- `conv_patch_embed`: the patch embedding as diffusers' `nn.Conv3d` on the latent video (strided convolution); the
  fast engine runs it as one GEMM on the packed tokens.
- `time_rows`: the time MLP and its six-row projection once per sample (or per token, TI2V-5B's 8k+ rows) as
  diffusers computes them; the fast engine computes them once per distinct timestep and gathers (GEMMs of other M).
- `eager_modulation`: the fp32 LayerNorm + scale/shift and gated residuals as diffusers' PyTorch ops; the fast path
  runs the Triton kernels on CUDA (a fused fp32 chain: other reduction order and FMAs). On the CPU the fast path is
  these very PyTorch ops, so this patch changes nothing there (tested as an equality).
- `unpacked_qkv`: one GEMM per projection (q, k, v; and the text's k, v), each with its bias, instead of a packed
  GEMM (equal on this CPU; a GEMM of another N may take another kernel on a GPU).
- `attention_kernel`: the SDPA kernel of the train side's diffusers backend pinned (`_native_flash` by default: the
  pipeline passes no text mask, so flash takes every call).
- `lora_unmerged`: LoRA kept unmerged, evaluated as PEFT does: `(W x + b) + (B(A x))·s`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...layers.linear import Linear
from ...layers.modulation import GatedResidual, LayerNormScaleShift, rows
from ...layers.rope import QKNormAcrossHeadsRope, RopeTables
from ...patches import Patch, PatchGroup, attention_kernel, set_on
from .latents import unpack_latents
from .transformer import (ConditionEmbedder, CrossAttention, PatchEmbedding, RotaryEmbedding, SelfAttention,
                          WanConfig, WanTransformer, time_rows_reference)


# -- RoPE ----------------------------------------------------------------------------------------------------------
def _axis_tables(dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' `get_1d_rotary_pos_embed(dim, max_seq_len, theta, use_real=True, repeat_interleave_real=True,
    freqs_dtype=float64)` as `WanRotaryPosEmbed` calls it (float32 where MPS is available, as it does): cos and sin
    [max_seq_len, dim], each frequency repeated for its pair, rounded to fp32."""
    freqs_dtype = torch.float32 if torch.backends.mps.is_available() else torch.float64
    pos = torch.arange(max_seq_len)
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=freqs_dtype) / dim)) / 1.0
    freqs = torch.outer(pos, freqs)
    return (freqs.cos().repeat_interleave(2, dim=1, output_size=freqs.shape[1] * 2).float(),
            freqs.sin().repeat_interleave(2, dim=1, output_size=freqs.shape[1] * 2).float())


def rope_tables_reference(config: WanConfig, grid: tuple[int, int, int], device) -> RopeTables:
    """`WanRotaryPosEmbed`: the three axes' fp32 tables built on the CPU at construction (`_axis_tables`), then per
    forward each axis's rows for the grid broadcast over the others and concatenated (frames, rows, cols), [1, S, 1, D];
    the rotation reads the even channels (`freqs[..., 0::2]`), kept here as [S, D/2] on `device`."""
    f, h, w = grid
    axes = [_axis_tables(d, config.rope_max_seq_len, 10000.0) for d in config.rope_dims]

    def table(k: int) -> torch.Tensor:  # k = 0: cos, 1: sin
        t, r, c = (a[k] for a in axes)
        parts = (t[:f].view(f, 1, 1, -1).expand(f, h, w, -1), r[:h].view(1, h, 1, -1).expand(f, h, w, -1),
                 c[:w].view(1, 1, w, -1).expand(f, h, w, -1))
        return torch.cat(parts, dim=-1).reshape(f * h * w, -1)[:, 0::2].to(device)

    return RopeTables(cos=table(0), sin=table(1))


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int,
                           tables: RopeTables | None) -> torch.Tensor:
    """diffusers' `WanAttnProcessor`: `torch.nn.RMSNorm(H·D)` (PyTorch's own `rms_norm`, rounded to bf16 once), the
    heads unflattened, then `apply_rotary_emb` if tables are given: the pairs `x1, x2 = x.unflatten(-1, (-1, 2))`
    (bf16) against the fp32 tables, `x1·cos − x2·sin` and `x1·sin + x2·cos` in fp32 written into `empty_like(x)`
    (rounded). Returns [B, S, H, D]."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps).unflatten(-1, (heads, -1))
    if tables is None:
        return y
    assert tables.cos is not None and tables.sin is not None  # the real tables
    cos, sin = tables.cos[:, None, :], tables.sin[:, None, :]  # [S, 1, D/2], as freqs[..., 0::2] of [1, S, 1, D]
    x1, x2 = y.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(y)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(y)


# -- patch embedding -------------------------------------------------------------------------------------------------
def patch_embed_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grid: tuple[int, int, int],
                          patch: tuple[int, int, int]) -> torch.Tensor:
    """diffusers' `self.patch_embedding(hidden_states)` (`nn.Conv3d`, stride = kernel = patch) on the contiguous latent
    video, then `flatten(2).transpose(1, 2).contiguous()`."""
    video = unpack_latents(x, grid)
    return F.conv3d(video, weight, bias, stride=patch).flatten(2).transpose(1, 2).contiguous()


# -- modulation (fp32, as diffusers' block writes it) ----------------------------------------------------------------
def layer_norm_scale_shift_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                     eps: float) -> torch.Tensor:
    """`(norm(x.float()) * (1 + scale) + shift).type_as(x)`: `FP32LayerNorm(elementwise_affine=False)` on the fp32
    input, then the fp32 rows (the table plus the timestep's rows, in fp32), one rounding at the end."""
    return (F.layer_norm(x.float(), (x.shape[-1],), None, None, eps) * (1 + rows(scale, x)) + rows(shift, x)).type_as(x)


def gated_residual_reference(y: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`(hidden_states.float() + output * gate).type_as(hidden_states)`, the gate fp32 (the product promotes)."""
    return (residual.float() + y * rows(gate, y)).type_as(residual)


# -- the group ---------------------------------------------------------------------------------------------------------
# The train side's diffusers attention backend -> the engine kernel whose forward is bitwise that backend's.
TRAIN_ATTENTION_KERNELS = {"_native_flash": "flash", "_native_cudnn": "cudnn", "native": "sdpa",
                           "_native_math": "math"}
DEFAULT_TRAIN_ATTENTION_BACKEND = "_native_flash"


def make_group(train_attention_backend: str = DEFAULT_TRAIN_ATTENTION_BACKEND) -> PatchGroup:
    """The group for a train side that runs diffusers' attention backend `train_attention_backend`: the
    `attention_kernel` patch pins the kernel that backend runs; every other patch is the same."""
    kernel = attention_kernel(TRAIN_ATTENTION_KERNELS, train_attention_backend)
    return PatchGroup("wan", (
        Patch("rope_tables", "RoPE tables built per axis in float64 on the CPU and rounded to fp32, as diffusers",
              set_on(RotaryEmbedding, "impl", rope_tables_reference)),
        Patch("qk_norm_rope", "q/k RMSNorm across heads rounded to bf16, then RoPE in fp32 from it, rounded",
              set_on(QKNormAcrossHeadsRope, "impl", qk_norm_rope_reference)),
        Patch("conv_patch_embed", "the patch embedding as diffusers' Conv3d on the latent video, not a GEMM on tokens",
              set_on(PatchEmbedding, "impl", patch_embed_reference)),
        Patch("time_rows", "the time MLP and its projection once per sample (per token) as diffusers, not per "
                           "distinct timestep",
              set_on(ConditionEmbedder, "impl", time_rows_reference)),
        Patch("eager_modulation", "the fp32 LayerNorm modulation and gated residuals as diffusers' PyTorch ops, "
                                  "not fused kernels",
              lambda m: (set_on(LayerNormScaleShift, "impl", layer_norm_scale_shift_reference)(m),
                         set_on(GatedResidual, "impl", gated_residual_reference)(m))),
        Patch("unpacked_qkv", "separate q/k/v (and text k/v) GEMMs with the bias in the same call",
              set_on(Linear, "unpacked", True)),
        Patch("attention_kernel", f"the SDPA kernel of the train side's `{train_attention_backend}` backend "
                                  f"({'chosen by SDPA on the same call' if kernel == 'sdpa' else kernel + ' pinned'})",
              set_on((SelfAttention, CrossAttention), "backend", kernel)),
        Patch("lora_unmerged", "LoRA updates stay unmerged, evaluated in PEFT's order: (W x + b) + scale·B(A x)",
              set_on(WanTransformer, "lora_merge", False)),
    ))


GROUP = make_group()
