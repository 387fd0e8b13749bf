"""The rollout engine's SD3 / SD3.5 transformer (MMDiT, and SD3.5-Medium's MMDiT-X), readable top to bottom.

diffusers' `SD3Transformer2DModel` (diffusers 0.42.1, `models/transformers/transformer_sd3.py`,
`models/attention.py` `JointTransformerBlock`, `attention_processor.py` `JointAttnProcessor2_0`): a 2x2 patch
embedding with sin-cos positions cropped from a `pos_embed_max_size` square table; a timestep embedding plus a
projection of the pooled CLIP output; the caption projected to the model width; `num_layers` joint blocks, each an
adaLN-Zero modulation of both streams, one joint attention over [image, text] (image FIRST, unlike Qwen-Image), per
head q/k RMSNorm (SD3.5), and in the `dual_attention_layers` (MMDiT-X, SD3.5-Medium's first 13) a second, image-only
attention read from the same LayerNorm with its own modulation; the last block is "context pre-only" (its text
stream gets an adaLN-Continuous norm, feeds the attention and is dropped); the output an adaLN-Continuous norm and
a projection, unpatchified.

Built from a checkpoint's transformer config (never assuming a size); weights come from diffusers-format tensors
through `weights.py`. Its blocks are wired from the shared `trueflow.layers`, whose fast paths are a serving
engine's: packed q/k/v GEMMs, fused LayerNorm + modulation and residual + norm, the fused gated residual, q/k
RMSNorm in fp32 with one rounding, the patch embedding as one GEMM on packed 2x2 patches, each stream's attention
output made contiguous for its projection. The `sd3` patch group (`patches.py`) swaps them for train-exact
arithmetic. The model takes and returns the packed tokens `[B, (h/2)·(w/2), 4C]` of `latents.pack_latents`, and
knows nothing of files or parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.attention import attention, joint_buffer
from ...layers.feed_forward import FeedForward
from ...layers.linear import Linear
from ...layers.modulation import GatedResidual, LayerNormScaleShift, ScaleResidualLayerNormScaleShift
from ...layers.rope import QKNormRope
from ..spec import EngineModel
from ...layers.timestep import TIMESTEP_CHANNELS, timestep_proj
from .latents import unpack_latents

EPS = 1e-6  # every norm of SD3's transformer (the blocks pass eps=1e-6 to each)
QK_NORMS = (None, "rms_norm")  # SD3.0 has none, SD3.5 per-head RMSNorm


@dataclass(frozen=True)
class SD3Config:
    """The transformer's architecture, with the names (and defaults) of diffusers' `SD3Transformer2DModel` config."""

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16
    pos_embed_max_size: int | None = 96
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None

    @classmethod
    def from_dict(cls, config: dict) -> "SD3Config":
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        kwargs["dual_attention_layers"] = tuple(kwargs.get("dual_attention_layers", ()))
        cfg = cls(**kwargs)
        if cfg.out_channels is None:
            cfg = cls(**{**kwargs, "out_channels": cfg.in_channels})
        if cfg.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {cfg.qk_norm!r}: the engine implements SD3's {QK_NORMS}")
        if cfg.pos_embed_max_size is None:
            raise ValueError("the engine needs pos_embed_max_size (every SD3 checkpoint sets it: its positions are "
                             "cropped from that table)")
        if cfg.caption_projection_dim != cfg.inner_dim:
            raise ValueError(f"caption_projection_dim {cfg.caption_projection_dim} must equal the model width "
                             f"{cfg.inner_dim} (heads x head dim): the blocks add the text stream to that width")
        return cfg

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# -- embeddings ----------------------------------------------------------------------------------------------------
class PatchConv(nn.Module):
    """The patch embedding's weights, named as diffusers' `pos_embed.proj` (an `nn.Conv2d` with kernel = stride =
    patch): weight [D, C, p, p], bias [D]."""

    def __init__(self, in_channels: int, dim: int, patch: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, in_channels, patch, patch))
        self.bias = nn.Parameter(torch.empty(dim))


def patch_embed_fused(tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grid: tuple[int, int],
                      pos: torch.Tensor) -> torch.Tensor:
    """The patch embedding as one GEMM on the packed 2x2 patches (channel order (c, p, q), the flattened conv
    weight's), plus the positions (bf16 + bf16: one rounding, as diffusers' add)."""
    return (F.linear(tokens, weight.flatten(1), bias) + pos).to(tokens.dtype)


class PatchEmbed(nn.Module):
    """diffusers' `PatchEmbed` with `pos_embed_max_size`: the conv patch embedding plus the sin-cos positions of the
    centred `rows x cols` crop of the `max x max` table (a persistent buffer in diffusers, a frozen parameter here
    so it loads with the weights). `impl` chooses how the patches are embedded (fast: one GEMM on the tokens)."""

    def __init__(self, in_channels: int, dim: int, patch: int, max_size: int):
        super().__init__()
        self.max_size, self.patch = max_size, patch
        self.proj = PatchConv(in_channels, dim, patch)
        self.pos_embed = nn.Parameter(torch.empty(1, max_size * max_size, dim))
        self.impl = patch_embed_fused

    def cropped(self, rows: int, cols: int) -> torch.Tensor:
        """`PatchEmbed.cropped_pos_embed`: the centred crop, [1, rows·cols, D]."""
        if rows > self.max_size or cols > self.max_size:
            raise ValueError(f"an image of {rows}x{cols} patches exceeds the transformer's position table of "
                             f"{self.max_size}x{self.max_size} patches (pos_embed_max_size): use a smaller size")
        top, left = (self.max_size - rows) // 2, (self.max_size - cols) // 2
        table = self.pos_embed.reshape(1, self.max_size, self.max_size, -1)[:, top:top + rows, left:left + cols, :]
        return table.reshape(1, -1, table.shape[-1])

    def forward(self, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        return self.impl(tokens, self.proj.weight, self.proj.bias, grid, self.cropped(*grid))


class MLPEmbedding(nn.Module):
    """`linear_2(SiLU(linear_1(x)))`: diffusers' `TimestepEmbedding` and `PixArtAlphaTextProjection(act_fn="silu")`."""

    def __init__(self, in_features: int, dim: int):
        super().__init__()
        self.linear_1 = Linear(in_features, dim)
        self.linear_2 = Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    """diffusers' `CombinedTimestepTextProjEmbeddings`: the embedded timestep sinusoid plus the projected pooled text.

    The pipeline passes the fp32 schedule timestep (0..1000) itself and `Timesteps` computes its sinusoid in fp32,
    cast to the pooled projection's dtype: exactly the engine's `timestep_proj`, so this path needs no patch."""

    def __init__(self, dim: int, pooled_dim: int):
        super().__init__()
        self.timestep_embedder = MLPEmbedding(TIMESTEP_CHANNELS, dim)
        self.text_embedder = MLPEmbedding(pooled_dim, dim)

    def forward(self, t: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.timestep_embedder(timestep_proj(t).to(pooled.dtype)) + self.text_embedder(pooled)


# -- modulation ----------------------------------------------------------------------------------------------------
class AdaNormZero(nn.Module):
    """adaLN-Zero's modulation GEMM (`norm1.linear`, `norm1_context.linear`: 6 rows of (shift, scale, gate) for the
    attention, then the MLP; SD3.5's `SD35AdaLayerNormZeroX`: 9, the second attention's last) and the attention
    half's LayerNorm + modulation (one per attention reading the norm)."""

    def __init__(self, dim: int, rows: int):
        super().__init__()
        self.linear = Linear(dim, rows * dim)
        self.rows = rows
        self.norms = nn.ModuleList(LayerNormScaleShift(EPS) for _ in range(1 + (rows == 9)))

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor):
        """(normed inputs of each attention, the modulation rows)."""
        mod = self.linear(temb_act).chunk(self.rows, dim=1)
        normed = [self.norms[0](x, mod[0], mod[1])]
        if self.rows == 9:  # the second attention reads the same LayerNorm, modulated by its own rows
            normed.append(self.norms[1](x, mod[6], mod[7]))
        return normed, mod


class AdaNormContinuous(nn.Module):
    """diffusers' `AdaLayerNormContinuous`: `LN(x)·(1+scale)+shift` with (scale, shift) = `linear(SiLU(c))` (chunked
    scale first, unlike adaLN-Zero's shift first)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = Linear(dim, 2 * dim)
        self.norm = LayerNormScaleShift(EPS)

    def forward(self, x: torch.Tensor, temb_act: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(temb_act.to(x.dtype)).chunk(2, dim=1)
        return self.norm(x, shift, scale)


# -- attention -----------------------------------------------------------------------------------------------------
def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    return t.unflatten(-1, (-1, head_dim))


class JointAttention(nn.Module):
    """`JointAttnProcessor2_0`: q/k/v of the image and the text stream, each q/k RMS-normed per head, one attention
    over [image, text], the output split back; the text output projected unless the block is context pre-only
    (then returned unprojected, as diffusers' attention returns it, and dropped by the block)."""

    def __init__(self, dim: int, heads: int, head_dim: int, qk_norm: bool, context_pre_only: bool):
        super().__init__()
        inner = heads * head_dim
        self.head_dim, self.context_pre_only = head_dim, context_pre_only
        self.to_qkv = Linear(dim, 3 * inner, splits=(inner,) * 3)
        self.add_qkv = Linear(dim, 3 * inner, splits=(inner,) * 3)
        norm = (lambda: QKNormRope(head_dim, EPS)) if qk_norm else (lambda: None)
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = norm(), norm(), norm(), norm()
        self.to_out = Linear(inner, dim)
        self.to_add_out = None if context_pre_only else Linear(inner, dim)
        self.backend = "sdpa"
        self.strided_split = False  # fast: each stream's output rows made contiguous for its own GEMM

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        iq, ik, iv = (_heads(t, self.head_dim) for t in self.to_qkv(img))
        tq, tk, tv = (_heads(t, self.head_dim) for t in self.add_qkv(txt))
        seq = img.shape[1]
        # The joint [image, text] q, k and v, each in one buffer laid out for the kernel; the q/k norms write their
        # rows in place (the values of diffusers' torch.cat).
        q, k, v = (joint_buffer(iq, tq, self.backend) for _ in range(3))
        for dst, x, norm in ((q, (iq, tq), (self.norm_q, self.norm_added_q)),
                             (k, (ik, tk), (self.norm_k, self.norm_added_k))):
            for part, rows, n in ((x[0], slice(None, seq), norm[0]), (x[1], slice(seq, None), norm[1])):
                if n is None:
                    dst[:, rows].copy_(part)
                else:
                    n(part, None, out=dst[:, rows])
        v[:, :seq].copy_(iv)
        v[:, seq:].copy_(tv)
        # Flatten the heads, then split, as diffusers' `transpose(1, 2).reshape(B, -1, H·D)` and slices do.
        out = attention(q, k, v, None, self.backend).flatten(2, 3).to(q.dtype)
        img_out, txt_out = out[:, :seq], out[:, seq:]
        if not self.strided_split:
            img_out, txt_out = img_out.contiguous(), txt_out.contiguous()
        return self.to_out(img_out), txt_out if self.to_add_out is None else self.to_add_out(txt_out)


class SelfAttention(nn.Module):
    """MMDiT-X's second attention (`attn2`): the image stream alone, per-head q/k RMSNorm."""

    def __init__(self, dim: int, heads: int, head_dim: int, qk_norm: bool):
        super().__init__()
        inner = heads * head_dim
        self.head_dim = head_dim
        self.to_qkv = Linear(dim, 3 * inner, splits=(inner,) * 3)
        self.norm_q: QKNormRope | None = QKNormRope(head_dim, EPS) if qk_norm else None
        self.norm_k: QKNormRope | None = QKNormRope(head_dim, EPS) if qk_norm else None
        self.to_out = Linear(inner, dim)
        self.backend = "sdpa"

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, self.head_dim) for t in self.to_qkv(img))
        if self.norm_q is not None and self.norm_k is not None:  # both or neither (qk_norm)
            q, k = self.norm_q(q, None), self.norm_k(k, None)
        return self.to_out(attention(q, k, v, None, self.backend).flatten(2, 3).to(q.dtype))


# -- blocks --------------------------------------------------------------------------------------------------------
class JointBlock(nn.Module):
    """`JointTransformerBlock`: returns (text, image), the text None after a context pre-only block."""

    def __init__(self, dim: int, heads: int, head_dim: int, qk_norm: bool, context_pre_only: bool, dual: bool):
        super().__init__()
        self.context_pre_only, self.dual = context_pre_only, dual
        self.norm1 = AdaNormZero(dim, 9 if dual else 6)
        self.norm1_context = AdaNormContinuous(dim) if context_pre_only else AdaNormZero(dim, 6)
        self.attn = JointAttention(dim, heads, head_dim, qk_norm, context_pre_only)
        self.attn2 = SelfAttention(dim, heads, head_dim, qk_norm) if dual else None
        self.attn_gate_add = GatedResidual()
        self.norm2 = ScaleResidualLayerNormScaleShift(EPS)
        self.ff = FeedForward(dim, 4 * dim)
        self.ff_gate_add = GatedResidual()
        if not context_pre_only:
            self.norm2_context = ScaleResidualLayerNormScaleShift(EPS)
            self.ff_context = FeedForward(dim, 4 * dim)
            self.ff_context_gate_add = GatedResidual()

    def forward(self, img: torch.Tensor, txt: torch.Tensor, temb_act: torch.Tensor):
        normed, m = self.norm1(img, temb_act)  # shift, scale, gate (attention), shift, scale, gate (MLP)[, attn2's]
        if self.context_pre_only:
            txt_normed = self.norm1_context(txt, temb_act)
        else:
            (txt_normed,), c = self.norm1_context(txt, temb_act)
        img_attn, txt_attn = self.attn(normed[0], txt_normed)
        if self.dual:  # h + gate·attn, then + gate2·attn2, then the MLP's norm of that
            assert self.attn2 is not None  # built with `dual`
            img = self.attn_gate_add(img_attn, m[2], img)
            img, img_x = self.norm2(img, self.attn2(normed[1]), m[8], m[3], m[4])
        else:
            img, img_x = self.norm2(img, img_attn, m[2], m[3], m[4])
        img = self.ff_gate_add(self.ff(img_x), m[5], img)
        if self.context_pre_only:
            return None, img
        txt, txt_x = self.norm2_context(txt, txt_attn, c[2], c[3], c[4])
        txt = self.ff_context_gate_add(self.ff_context(txt_x), c[5], txt)
        return txt, img  # diffusers' order: (encoder_hidden_states, hidden_states)


class SD3Transformer(EngineModel):
    def __init__(self, config: SD3Config):
        super().__init__()
        self.config = c = config
        dim = c.inner_dim
        assert c.out_channels is not None and c.pos_embed_max_size is not None  # `SD3Config.from_dict` sets them
        self.pos_embed = PatchEmbed(c.in_channels, dim, c.patch_size, c.pos_embed_max_size)
        self.time_text_embed = TimeTextEmbed(dim, c.pooled_projection_dim)
        self.context_embedder = Linear(c.joint_attention_dim, c.caption_projection_dim)
        self.transformer_blocks = nn.ModuleList(
            JointBlock(dim, c.num_attention_heads, c.attention_head_dim, c.qk_norm is not None,
                       context_pre_only=i == c.num_layers - 1, dual=i in c.dual_attention_layers)
            for i in range(c.num_layers))
        self.norm_out = AdaNormContinuous(dim)
        self.proj_out = Linear(dim, c.patch_size * c.patch_size * c.out_channels)
        self.lora_merge = True  # fast default: a LoRA update is folded into the weights

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, grid: tuple[int, int],
                encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor) -> torch.Tensor:
        """hidden_states: packed latents [B, rows·cols, 4C] (`latents.pack_latents`); timestep: [B] fp32 schedule
        timesteps (0..1000, what the pipeline passes); grid: (rows, cols) in patches; encoder_hidden_states: the
        joint CLIP + T5 tokens [B, L, joint_attention_dim]; pooled_projections: [B, pooled_projection_dim].
        Returns the prediction packed as the latents are."""
        img = self.pos_embed(hidden_states, grid)
        temb = self.time_text_embed(timestep, pooled_projections)
        txt = self.context_embedder(encoder_hidden_states)
        temb_act = F.silu(temb)  # every modulation reads SiLU(temb); computed once
        for block in self.transformer_blocks:
            txt, img = block(img, txt, temb_act)
        out = self.proj_out(self.norm_out(img, temb_act))
        # Unpatchify's channel order (p, q, c) -> the packed latents' (c, p, q): a permutation, no arithmetic.
        p, channels = self.config.patch_size, self.config.out_channels
        return out.unflatten(-1, (p, p, channels)).permute(0, 1, 4, 2, 3).flatten(2)


def conv_input(tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The packed tokens as the contiguous `[B, C, h, w]` latents the pipeline hands the transformer's conv."""
    return unpack_latents(tokens, grid).contiguous()


def build_model(config: SD3Config | dict, device="cpu", dtype: torch.dtype = torch.bfloat16) -> SD3Transformer:
    """An engine model with uninitialised parameters on `device` (weights come from `weights.load_weights`)."""
    if isinstance(config, dict):
        config = SD3Config.from_dict(config)
    with torch.device("meta"):
        model = SD3Transformer(config)
    return model.to(dtype).to_empty(device=device).eval().requires_grad_(False)
