"""The rollout engine's FLUX.1 transformer (MMDiT: double-stream blocks, then single-stream parallel blocks),
readable top to bottom.

Built from a checkpoint's transformer config (never assuming a size); weights come from diffusers-format tensors
through `weights.py`. Its blocks are wired from the shared `trueflow.layers`, whose fast paths are a serving
engine's: packed q/k/v GEMMs (in a single-stream block the MLP's input projection too, since it reads the same
normed input), fused LayerNorm + scale/shift and residual-gate, the fused gated residual, fused qk-norm + RoPE from
fp32 cos/sin tables built on the device, the joint [text, image] sequence kept whole across the single-stream blocks
(diffusers concatenates and splits it in every block: copies, the same values), and the timestep and guidance kept
in fp32. The `flux` patch group (`patches.py`) swaps them for train-exact arithmetic. The model knows nothing of
files or parallelism.

Where diffusers' `FluxTransformer2DModel` (diffusers 0.42.1, `models/transformers/transformer_flux.py`) differs from
a plain MMDiT, this follows it: the timestep and the guidance scale are each embedded by their own MLP, summed with
the pooled CLIP projection (`CombinedTimestepGuidanceTextProjEmbeddings`); RoPE angles come from 3-axis position ids
(text ids all zero, image ids (0, row, col)) over the joint sequence; the q/k norms are PyTorch's `nn.RMSNorm`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.attention import attention, joint_buffer
from ...layers.feed_forward import FeedForward
from ...layers.linear import Linear
from ...layers.modulation import GatedResidual, LayerNormScaleShift, ScaleResidualLayerNormScaleShift
from ...layers.rope import QKNormRope, RopeTables, rope_tables_fused
from ..spec import EngineModel
from ...layers.timestep import TIMESTEP_CHANNELS, timestep_proj

ROPE_THETA = 10000  # FluxPosEmbed(theta=10000, ...) in FluxTransformer2DModel.__init__
MLP_RATIO = 4  # the single-stream block's MLP width and the double-stream FeedForward's (mult 4)


@dataclass(frozen=True)
class FluxConfig:
    """The transformer's architecture, with the names of diffusers' `FluxTransformer2DModel` config."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = True
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)

    @classmethod
    def from_dict(cls, config: dict) -> "FluxConfig":
        if not config.get("guidance_embeds", False):
            raise ValueError("this FLUX transformer config has guidance_embeds=False (FLUX.1-schnell's unguided "
                             "variant), which the engine does not implement: use a guidance-distilled FLUX.1-dev "
                             "checkpoint")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        if "axes_dims_rope" in kwargs:
            kwargs["axes_dims_rope"] = tuple(kwargs["axes_dims_rope"])
        if kwargs.get("out_channels") is None:  # diffusers: `out_channels or in_channels`
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        cfg = cls(**kwargs)
        if sum(cfg.axes_dims_rope) != cfg.attention_head_dim:
            raise ValueError(f"axes_dims_rope {cfg.axes_dims_rope} must sum to attention_head_dim "
                             f"{cfg.attention_head_dim}")
        return cfg

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# -- timestep, guidance and pooled text: the conditioning vector ----------------------------------------------
def timestep_proj_fused(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sinusoid of the fp32 schedule timestep `t` (0..1000) in fp32, rounded to `dtype` once: the pipeline's
    `/ 1000` and the model's `· 1000` cancel in exact arithmetic."""
    return timestep_proj(t).to(dtype)


def guidance_proj_fused(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sinusoid of the fp32 distilled guidance scale `g` on the model's 0..1000 scale (`g · 1000`), in fp32,
    rounded to `dtype` once."""
    return timestep_proj(g.float() * 1000).to(dtype)


class MLPEmbedder(nn.Module):
    """linear_1, SiLU, linear_2: diffusers' `TimestepEmbedding` and `PixArtAlphaTextProjection(act_fn="silu")`."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = Linear(in_dim, dim)
        self.linear_2 = Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeGuidanceTextEmbedding(nn.Module):
    """`CombinedTimestepGuidanceTextProjEmbeddings`: (timestep MLP + guidance MLP) + pooled-text MLP, each sum in the
    model dtype. `timestep_impl` / `guidance_impl` make the sinusoids of the timestep and of the guidance scale in
    the model dtype from what the engine is given (the fp32 schedule timestep, the fp32 scale)."""

    def __init__(self, dim: int, pooled_dim: int):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(TIMESTEP_CHANNELS, dim)
        self.guidance_embedder = MLPEmbedder(TIMESTEP_CHANNELS, dim)
        self.text_embedder = MLPEmbedder(pooled_dim, dim)
        self.timestep_impl, self.guidance_impl = timestep_proj_fused, guidance_proj_fused

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """timestep: fp32 schedule timesteps [B] (0..1000); guidance: the fp32 distilled scale [B]; pooled [B, P]."""
        dtype = pooled.dtype
        emb = self.timestep_embedder(self.timestep_impl(timestep, dtype))
        emb = emb + self.guidance_embedder(self.guidance_impl(guidance, dtype))
        return emb + self.text_embedder(pooled)


# -- rotary positions ----------------------------------------------------------------------------------------
def position_ids(grid: tuple[int, int], text_len: int) -> torch.Tensor:
    """Integer position ids of the joint [text, image] sequence, [L + H·W, 3]: the text's all zero (FluxPipeline's
    `encode_prompt`: `torch.zeros(L, 3)`), an image token's (0, row, col) (`_prepare_latent_image_ids`)."""
    rows, cols = grid
    img = torch.stack(torch.meshgrid(torch.zeros(1, dtype=torch.long), torch.arange(rows), torch.arange(cols),
                                     indexing="ij"), dim=-1).reshape(-1, 3)
    return torch.cat([torch.zeros(text_len, 3, dtype=torch.long), img])


def rope_tables_fast(grid: tuple[int, int], text_len: int, axes_dim: tuple[int, ...], device,
                     dtype: torch.dtype) -> RopeTables:
    """Interleaved fp32 cos/sin [L + S, D/2] of the joint sequence, angles computed on the device in fp32."""
    return rope_tables_fused(position_ids(grid, text_len), axes_dim, ROPE_THETA, device)


class RotaryEmbedding(nn.Module):
    """Builds the joint sequence's rotation tables of one forward shape; `impl` chooses how (fast: fp32 on the
    device), called `impl(grid, text_len, axes_dim, device, dtype)` (`dtype` the model's: the pipeline makes its
    position ids in it)."""

    def __init__(self, axes_dim: tuple[int, ...]):
        super().__init__()
        self.axes_dim = tuple(axes_dim)
        self.impl: Callable[..., RopeTables] = rope_tables_fast  # a patch group may swap it
        self._cache: dict = {}

    def forward(self, grid: tuple[int, int], text_len: int, device, dtype: torch.dtype) -> RopeTables:
        key = (self.impl, tuple(grid), text_len, str(device), dtype)
        if key not in self._cache:
            self._cache[key] = self.impl(tuple(grid), text_len, self.axes_dim, device, dtype)
        return self._cache[key]


def rows_of(tables: RopeTables, rows: slice) -> RopeTables:
    """The tables of a slice of the joint sequence (the text's or the image's rows)."""
    return RopeTables(cos=None if tables.cos is None else tables.cos[rows],
                      sin=None if tables.sin is None else tables.sin[rows], pairs=tables.pairs)


# -- blocks --------------------------------------------------------------------------------------------------
class AdaNormZero(nn.Module):
    """diffusers' `AdaLayerNormZero` (6 rows) / `AdaLayerNormZeroSingle` (3 rows): `linear(SiLU(temb))` chunked
    (shift, scale, gate, ...), the first (shift, scale) modulating the LayerNorm of x."""

    def __init__(self, dim: int, rows: int):
        super().__init__()
        self.rows = rows
        self.linear = Linear(dim, rows * dim)
        self.norm = LayerNormScaleShift(1e-6)

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shift, scale, *rest = self.linear(temb_act).chunk(self.rows, dim=-1)
        return (self.norm(x, shift, scale), *rest)


class JointAttention(nn.Module):
    """The double-stream block's attention over [text, image]: packed q/k/v per stream, qk-norm + RoPE, one
    attention, split back, each stream's output projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        inner = heads * head_dim
        self.head_dim = head_dim
        self.to_qkv = Linear(dim, 3 * inner, splits=(inner, inner, inner))
        self.add_qkv = Linear(dim, 3 * inner, splits=(inner, inner, inner))
        self.norm_q, self.norm_k = QKNormRope(head_dim, eps), QKNormRope(head_dim, eps)
        self.norm_added_q, self.norm_added_k = QKNormRope(head_dim, eps), QKNormRope(head_dim, eps)
        self.to_out = Linear(inner, dim)
        self.to_add_out = Linear(inner, dim)
        self.backend = "sdpa"
        self.contiguous_split = False  # a strided slice is fine for a fast engine's own GEMM

    def forward(self, img: torch.Tensor, txt: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        seq_txt = txt.shape[1]
        txt_tables, img_tables = rows_of(rope, slice(0, seq_txt)), rows_of(rope, slice(seq_txt, None))
        iq, ik, iv = (t.unflatten(-1, (-1, self.head_dim)) for t in self.to_qkv(img))
        tq, tk, tv = (t.unflatten(-1, (-1, self.head_dim)) for t in self.add_qkv(txt))
        # The joint [text, image] q, k and v, each in one buffer laid out for the kernel: the qk-norms write their
        # rows in place, so no torch.cat copies q and k (the values are the concatenation's, bit for bit).
        q, k, v = (joint_buffer(tq, iq, self.backend) for _ in range(3))
        self.norm_added_q(tq, txt_tables, out=q[:, :seq_txt])
        self.norm_q(iq, img_tables, out=q[:, seq_txt:])
        self.norm_added_k(tk, txt_tables, out=k[:, :seq_txt])
        self.norm_k(ik, img_tables, out=k[:, seq_txt:])
        v[:, :seq_txt].copy_(tv)
        v[:, seq_txt:].copy_(iv)
        out = attention(q, k, v, None, self.backend).to(q.dtype)
        txt_out, img_out = out[:, :seq_txt].flatten(2, 3), out[:, seq_txt:].flatten(2, 3)
        if self.contiguous_split:  # diffusers' processor: `to_out[0](hidden_states.contiguous())`
            txt_out, img_out = txt_out.contiguous(), img_out.contiguous()
        return self.to_out(img_out), self.to_add_out(txt_out)


class TransformerBlock(nn.Module):
    """`FluxTransformerBlock`: a stream each for image and text with their own modulation, attention over both."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.norm1, self.norm1_context = AdaNormZero(dim, 6), AdaNormZero(dim, 6)
        self.attn = JointAttention(dim, heads, head_dim, eps)
        self.norm2 = ScaleResidualLayerNormScaleShift(1e-6)
        self.norm2_context = ScaleResidualLayerNormScaleShift(1e-6)
        self.ff, self.ff_context = FeedForward(dim, MLP_RATIO * dim), FeedForward(dim, MLP_RATIO * dim)
        self.ff_gate, self.ff_context_gate = GatedResidual(), GatedResidual()

    def forward(self, img, txt, temb_act, rope):
        img_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(img, temb_act)
        txt_x, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(txt, temb_act)
        img_attn, txt_attn = self.attn(img_x, txt_x, rope)
        img, img_x = self.norm2(img, img_attn, gate_msa, shift_mlp, scale_mlp)
        img = self.ff_gate(self.ff(img_x), gate_mlp, img)
        txt, txt_x = self.norm2_context(txt, txt_attn, c_gate_msa, c_shift_mlp, c_scale_mlp)
        txt = self.ff_context_gate(self.ff_context(txt_x), c_gate_mlp, txt)
        return txt, img  # diffusers' order: (encoder_hidden_states, hidden_states)


class SelfAttention(nn.Module):
    """The single-stream block's attention over the joint sequence (q/k/v come from the block's packed GEMM):
    qk-norm + RoPE, attention, heads flattened. No output projection: the block's `proj_out` follows."""

    def __init__(self, heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.head_dim = head_dim
        self.norm_q, self.norm_k = QKNormRope(head_dim, eps), QKNormRope(head_dim, eps)
        self.backend = "sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        out = attention(self.norm_q(q, rope), self.norm_k(k, rope), v, None, self.backend)
        return out.flatten(2, 3).to(q.dtype)


class ConcatLinear(Linear):
    """`proj_out` of a single-stream block: one GEMM over the attention output and the MLP's activation,
    concatenated on the feature axis in that order (`torch.cat([attn_output, mlp_hidden_states], dim=2)`)."""

    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.cat(parts, dim=-1))


class SingleTransformerBlock(nn.Module):
    """`FluxSingleTransformerBlock` on the joint [text, image] sequence: one modulation, attention and MLP in
    parallel from the same normed input, one output projection over both, gated into the residual."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        inner, mlp = heads * head_dim, MLP_RATIO * dim
        self.norm = AdaNormZero(dim, 3)
        # q, k, v and the MLP's input projection (diffusers' attn.to_q/to_k/to_v and proj_mlp) read the same input.
        self.attn_mlp = Linear(dim, 3 * inner + mlp, splits=(inner, inner, inner, mlp))
        self.attn = SelfAttention(heads, head_dim, eps)
        self.proj_out = ConcatLinear(inner + mlp, dim)
        self.gate = GatedResidual()

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        xn, gate = self.norm(x, temb_act)
        q, k, v, mlp = self.attn_mlp(xn)
        return self.gate(self.proj_out(self.attn(q, k, v, rope), F.gelu(mlp, approximate="tanh")), gate, x)


class OutputNorm(nn.Module):
    """`AdaLayerNormContinuous`: its modulation chunks as (scale, shift), unlike the blocks' (shift, scale, gate)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = Linear(dim, 2 * dim)
        self.norm = LayerNormScaleShift(1e-6)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=-1)
        return self.norm(x, shift, scale)


class FluxTransformer(EngineModel):
    def __init__(self, config: FluxConfig):
        super().__init__()
        self.config = c = config
        dim, heads, head_dim = c.inner_dim, c.num_attention_heads, c.attention_head_dim
        self.rope = RotaryEmbedding(c.axes_dims_rope)
        self.time_text_embed = TimeGuidanceTextEmbedding(dim, c.pooled_projection_dim)
        self.context_embedder = Linear(c.joint_attention_dim, dim)
        self.x_embedder = Linear(c.in_channels, dim)
        self.transformer_blocks = nn.ModuleList(TransformerBlock(dim, heads, head_dim) for _ in range(c.num_layers))
        self.single_transformer_blocks = nn.ModuleList(
            SingleTransformerBlock(dim, heads, head_dim) for _ in range(c.num_single_layers))
        self.norm_out = OutputNorm(dim)
        self.proj_out = Linear(dim, c.patch_size * c.patch_size * c.out_channels)
        self.lora_merge = True  # fast default: a LoRA update is folded into the weights

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, grid: tuple[int, int],
                encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor,
                guidance: torch.Tensor) -> torch.Tensor:
        """hidden_states: packed latents [B, H·W, C]; timestep: [B] fp32 schedule timesteps (0..1000; the model's own
        timestep path decides how it is scaled and rounded); grid: (H, W) in tokens; encoder_hidden_states: T5's
        [B, L, joint_dim]; pooled_projections: CLIP's pooled [B, P]; guidance: the fp32 distilled scale [B]."""
        img = self.x_embedder(hidden_states)
        temb = self.time_text_embed(timestep, guidance, pooled_projections)
        txt = self.context_embedder(encoder_hidden_states)
        seq_txt = txt.shape[1]
        rope = self.rope(grid, seq_txt, img.device, img.dtype)
        temb_act = F.silu(temb)  # every block's modulation reads SiLU(temb); computed once
        for block in self.transformer_blocks:
            txt, img = block(img, txt, temb_act, rope)
        x = torch.cat([txt, img], dim=1)
        for block in self.single_transformer_blocks:
            x = block(x, temb_act, rope)
        return self.proj_out(self.norm_out(x[:, seq_txt:], temb))


def build_model(config: FluxConfig | dict, device="cpu", dtype: torch.dtype = torch.bfloat16) -> FluxTransformer:
    """An engine model with uninitialised parameters on `device` (weights come from `weights.load_weights`)."""
    if isinstance(config, dict):
        config = FluxConfig.from_dict(config)
    with torch.device("meta"):
        model = FluxTransformer(config)
    return model.to(dtype).to_empty(device=device).eval().requires_grad_(False)
