"""The rollout engine's Wan2.2 video transformer (diffusers' `WanTransformer3DModel`), readable top to bottom.

One class serves both Wan2.2 layouts: each expert of the A14B (40 layers, 40 heads x 128) and the dense TI2V-5B (30
layers, 24 heads x 128, 48 latent channels, one timestep per token). Built from a checkpoint's transformer config
(never assuming a size); weights come from diffusers-format tensors through `weights.py`.

Tokens are the transformer's patches: `latents.pack_latents` lays a latent video `[B, C, F, H, W]` out as
`[B, F'·H'·W', C·pt·ph·pw]`, each token the values its Conv3d patch embedding reads, in the conv weight's order; the
model returns its prediction in the same layout, and `grid` is the post-patch `(F', H', W')`.

Numerics as diffusers loads the model (`from_pretrained(torch_dtype=bf16)` keeps `_keep_in_fp32_modules` in fp32: the
time embedder, every `scale_shift_table`, the cross-attention norm, the RoPE tables), so its modulation chains run in
fp32 with one rounding each, as a fused kernel computes them. The engine's own fast paths: the patch embedding as one
GEMM on the packed tokens (not a strided Conv3d), one packed GEMM for q/k/v (and k/v of the text), the q/k RMSNorm
across heads fused with the RoPE in fp32, RoPE tables computed in fp32 on the device, the time rows computed once per
distinct timestep (not once per token), the fp32 modulation and gated residuals on the fused kernels (Triton on CUDA,
where the rows are `[B, D]`). The `wan` patch
group (`patches.py`) swaps them for train-exact arithmetic. The model knows nothing of files or parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.attention import attention
from ...layers.feed_forward import FeedForward
from ...layers.linear import Linear
from ...layers.modulation import GatedResidual, LayerNormScaleShift
from ...layers.norms import LayerNorm
from ...layers.rope import QKNormAcrossHeadsRope, RopeTables
from ...layers.timestep import TIMESTEP_CHANNELS, timestep_proj
from ..spec import EngineModel
from .latents import first_frame_inputs

# What diffusers keeps in fp32 when it loads the model in another dtype (`WanTransformer3DModel._keep_in_fp32_modules`,
# matched as a component of a parameter's name); norm1, norm3 and norm_out have no parameters.
KEEP_IN_FP32 = ("time_embedder", "scale_shift_table", "norm2")


@dataclass(frozen=True)
class WanConfig:
    """The architecture, with the names and defaults of diffusers' `WanTransformer3DModel` config (an A14B expert's)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    eps: float = 1e-6
    rope_max_seq_len: int = 1024

    # Variants this engine does not implement (key: the value it requires): Wan2.1's image-to-video CLIP stream
    # (`image_dim`, `added_kv_proj_dim`), FLF2V's position embedding, per-head q/k norms.
    # The patch (1, 2, 2) of every published Wan2.x transformer is the token layout of `latents.py` (and WanPipeline's
    # `expand_timesteps` mask, `[:, ::2, ::2]`, assumes it).
    _REQUIRED = {"qk_norm": "rms_norm_across_heads", "image_dim": None, "added_kv_proj_dim": None,
                 "pos_embed_seq_len": None, "freq_dim": TIMESTEP_CHANNELS, "patch_size": [1, 2, 2]}

    @classmethod
    def from_dict(cls, config: dict) -> "WanConfig":
        def value(k, want):  # a config.json list or a preset's tuple
            v = config.get(k, want)
            return list(v) if isinstance(v, tuple) else v

        bad = [f"{k}={value(k, want)!r} (needs {want!r})" for k, want in cls._REQUIRED.items()
               if value(k, want) != want]
        if bad:
            raise ValueError(f"this Wan transformer config uses variants the engine does not implement: "
                             f"{', '.join(bad)}")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        if "patch_size" in kwargs:
            kwargs["patch_size"] = tuple(kwargs["patch_size"])
        if kwargs.get("out_channels") is None:  # diffusers: `out_channels or in_channels`
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        cfg = cls(**kwargs)
        if cfg.attention_head_dim % 2 or cfg.attention_head_dim < 6:
            raise ValueError(f"attention_head_dim {cfg.attention_head_dim} must be even and split over the three RoPE "
                             f"axes")
        return cfg

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """The head channels each RoPE axis rotates (frames, rows, cols): diffusers' `WanRotaryPosEmbed`."""
        h = w = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - h - w, h, w


# -- patch embedding ---------------------------------------------------------------------------------------------
def patch_embed_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grid: tuple[int, int, int],
                      patch: tuple[int, int, int]) -> torch.Tensor:
    """The Conv3d patch embedding as one GEMM on the packed tokens `[B, S, C·pt·ph·pw]` (each token its patch's
    values in the conv weight's order): the same sums, in a GEMM's order, not a convolution's."""
    return F.linear(x, weight.flatten(1), bias)


class PatchEmbedding(nn.Module):
    """diffusers' `patch_embedding`: `nn.Conv3d(in_channels, inner_dim, kernel_size=patch, stride=patch)`; parameters
    under the conv's names and shapes. `impl` chooses how it is computed."""

    def __init__(self, in_channels: int, dim: int, patch: tuple[int, int, int]):
        super().__init__()
        self.patch = patch
        self.weight = nn.Parameter(torch.empty(dim, in_channels, *patch))
        self.bias = nn.Parameter(torch.empty(dim))
        self.impl = patch_embed_fused

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        return self.impl(x, self.weight, self.bias, grid, self.patch)


# -- timestep and text -------------------------------------------------------------------------------------------
class TimeEmbedder(nn.Module):
    """diffusers' `condition_embedder.time_embedder` (`TimestepEmbedding`: linear_1, SiLU, linear_2, held in fp32)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = Linear(TIMESTEP_CHANNELS, dim)
        self.linear_2 = Linear(dim, dim)

    def forward(self, sinusoid: torch.Tensor) -> torch.Tensor:
        # diffusers casts the fp32 sinusoid to the embedder's dtype (fp32, as it is kept)
        return self.linear_2(F.silu(self.linear_1(sinusoid.to(self.linear_1.weight.dtype))))


def time_rows_reference(embedder: "ConditionEmbedder", t: torch.Tensor, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(temb, timestep_proj) for fp32 timesteps `t` ([B], or one per token [B, S]) as diffusers computes them, one row
    per entry: the sinusoid of the flattened timesteps (unflattened back to [B, S, 256] per token), the fp32 time MLP,
    its output cast to the model dtype (`.type_as(encoder_hidden_states)`), `time_proj(SiLU(temb))` in that dtype.
    Shapes [B, D] and [B, 6D], or [B, S, D] and [B, S, 6D]."""
    sinusoid = timestep_proj(t.flatten())
    if t.dim() == 2:
        sinusoid = sinusoid.unflatten(0, tuple(t.shape))
    temb = embedder.time_embedder(sinusoid).to(dtype)
    return temb, embedder.time_proj(F.silu(temb))


def time_rows_fused(embedder: "ConditionEmbedder", t: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`time_rows_reference` computed once per distinct timestep and gathered back: the time MLP and the six-row
    projection on a few rows (one, for a microgroup's shared step) instead of one per sample or token (TI2V-5B passes
    one timestep per token). `torch.unique` has a data-dependent shape, which a CUDA graph cannot capture: while one
    is being captured, the rows are computed one per entry."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return time_rows_reference(embedder, t, dtype)
    values, index = torch.unique(t, return_inverse=True)
    temb, proj = time_rows_reference(embedder, values, dtype)
    return temb[index], proj[index]


class ConditionEmbedder(nn.Module):
    """diffusers' `WanTimeTextImageEmbedding` without the image stream: the time embedding `temb`, its six
    modulation rows per block and the text projection. `impl` computes the time rows."""

    def __init__(self, dim: int, text_dim: int):
        super().__init__()
        self.time_embedder = TimeEmbedder(dim)
        self.time_proj = Linear(dim, 6 * dim)
        self.text_embedder = FeedForward(text_dim, dim, out_dim=dim)  # PixArtAlphaTextProjection, GELU-tanh
        self.impl = time_rows_fused

    def forward(self, t: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """t: fp32 [B] or [B, S] -> (temb [B(, S), D], timestep_proj [B(, S), 6D], text [B, L, D])."""
        temb, proj = self.impl(self, t, text.dtype)
        return temb, proj, self.text_embedder(text)


# -- rotary positions ----------------------------------------------------------------------------------------------
def rope_tables_fused(config: WanConfig, grid: tuple[int, int, int], device) -> RopeTables:
    """Interleaved tables [S, D/2] computed on the device in fp32: per axis `pos · θ^(-2j/d)` (frames, rows, cols
    over their share of the head), the token's (f, h, w) position, cos and sin."""
    angles = []
    for n, dim, axis in zip(grid, config.rope_dims, range(3)):
        inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        a = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv
        shape = [1, 1, 1, a.shape[-1]]
        shape[axis] = n
        angles.append(a.view(shape).expand(*grid, -1))
    a = torch.cat(angles, dim=-1).reshape(-1, config.attention_head_dim // 2)
    return RopeTables(cos=a.cos(), sin=a.sin())


class RotaryEmbedding(nn.Module):
    """The self-attention's tables for one token grid (cached); `impl` chooses how they are computed."""

    def __init__(self, config: WanConfig):
        super().__init__()
        self.config = config
        self.impl: Callable[..., RopeTables] = rope_tables_fused  # a patch group may swap it
        self._cache: dict = {}

    def forward(self, grid: tuple[int, int, int], device) -> RopeTables:
        key = (self.impl, tuple(grid), str(device))
        if key not in self._cache:
            if max(grid) > self.config.rope_max_seq_len:
                raise ValueError(f"grid {tuple(grid)} exceeds the transformer's rope_max_seq_len "
                                 f"{self.config.rope_max_seq_len} on an axis")
            self._cache[key] = self.impl(self.config, tuple(grid), device)
        return self._cache[key]


# -- blocks --------------------------------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    """q, k, v from one packed GEMM, q/k RMSNorm across heads + RoPE, SDPA, the output projection."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_qkv = Linear(dim, 3 * dim, splits=(dim, dim, dim))
        self.norm_q, self.norm_k = QKNormAcrossHeadsRope(dim, heads, eps), QKNormAcrossHeadsRope(dim, heads, eps)
        self.to_out = Linear(dim, dim)
        self.backend = "sdpa"

    def forward(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        q, k, v = self.to_qkv(x)
        out = attention(self.norm_q(q, tables), self.norm_k(k, tables), v.unflatten(-1, (self.heads, -1)), None,
                        self.backend)
        return self.to_out(out.flatten(2, 3))


class CrossAttention(nn.Module):
    """q from the video tokens, k and v from the text in one packed GEMM, q/k RMSNorm across heads (no RoPE), SDPA
    without a mask (the pipeline pads the text with zeros, not a mask), the output projection."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q = Linear(dim, dim)
        self.to_kv = Linear(dim, 2 * dim, splits=(dim, dim))
        self.norm_q, self.norm_k = QKNormAcrossHeadsRope(dim, heads, eps), QKNormAcrossHeadsRope(dim, heads, eps)
        self.to_out = Linear(dim, dim)
        self.backend = "sdpa"

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        k, v = self.to_kv(text)
        out = attention(self.norm_q(self.to_q(x), None), self.norm_k(k, None), v.unflatten(-1, (self.heads, -1)),
                        None, self.backend)
        return self.to_out(out.flatten(2, 3))


def modulation_rows(table: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's six modulation rows: its fp32 table `[1, 6, D]` plus the timestep's rows (`proj` `[B, 6D]`, or per
    token `[B, S, 6D]`), added in fp32 as diffusers adds them (`table + temb.float()`), as `[B, D]` per sample (the
    Triton kernels' shape on CUDA; diffusers' `[B, 1, D]` holds the same values) or `[B, S, D]` per token."""
    if proj.dim() == 2:
        return tuple(r.squeeze(1) for r in (table + proj.float().unflatten(1, (6, -1))).chunk(6, dim=1))
    return tuple(r.squeeze(2) for r in (table.unsqueeze(0) + proj.float().unflatten(2, (6, -1))).chunk(6, dim=2))


def output_rows(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output norm's (shift, scale): its fp32 table `[1, 2, D]` plus the time embedding (`temb` `[B, D]`, or per
    token `[B, S, D]`, in the model dtype), added in fp32 (`table + temb.unsqueeze(1)` promotes)."""
    if temb.dim() == 2:
        shift, scale = (table + temb.float().unsqueeze(1)).chunk(2, dim=1)
        return shift.squeeze(1), scale.squeeze(1)
    shift, scale = (table.unsqueeze(0) + temb.float().unsqueeze(2)).chunk(2, dim=2)
    return shift.squeeze(2), scale.squeeze(2)


class TransformerBlock(nn.Module):
    """diffusers' `WanTransformerBlock`: modulated self-attention, the (normed) text cross-attention added plainly,
    the modulated FFN; the gated residuals in fp32, each rounded once."""

    def __init__(self, c: WanConfig):
        super().__init__()
        dim = c.inner_dim
        self.scale_shift_table = nn.Parameter(torch.empty(1, 6, dim))
        self.norm1, self.norm3 = LayerNormScaleShift(c.eps), LayerNormScaleShift(c.eps)
        self.attn1 = SelfAttention(dim, c.num_attention_heads, c.eps)
        self.attn1_residual, self.ffn_residual = GatedResidual(), GatedResidual()
        self.norm2 = LayerNorm(dim, c.eps) if c.cross_attn_norm else None
        self.attn2 = CrossAttention(dim, c.num_attention_heads, c.eps)
        self.ffn = FeedForward(dim, c.ffn_dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor, proj: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        shift, scale, gate, c_shift, c_scale, c_gate = modulation_rows(self.scale_shift_table, proj)
        x = self.attn1_residual(self.attn1(self.norm1(x, shift, scale), tables), gate, x)
        x = x + self.attn2(x if self.norm2 is None else self.norm2(x), text)
        return self.ffn_residual(self.ffn(self.norm3(x, c_shift, c_scale)), c_gate, x)


class WanTransformer(EngineModel):
    def __init__(self, config: WanConfig):
        super().__init__()
        self.config = c = config
        dim = c.inner_dim
        self.rope = RotaryEmbedding(c)
        self.patch_embedding = PatchEmbedding(c.in_channels, dim, c.patch_size)
        self.condition_embedder = ConditionEmbedder(dim, c.text_dim)
        self.blocks = nn.ModuleList(TransformerBlock(c) for _ in range(c.num_layers))
        self.norm_out = LayerNormScaleShift(c.eps)
        self.proj_out = Linear(dim, c.out_channels * c.patch_volume)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, dim))
        self.lora_merge = True  # fast default: a LoRA update is folded into the weights

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, grid: tuple[int, int, int],
                encoder_hidden_states: torch.Tensor, image_latents: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states: packed patches [B, S, C·pt·ph·pw] (`latents.pack_latents`); timestep: fp32 schedule timesteps
        [B], or one per token [B, S] (TI2V-5B's `expand_timesteps`); grid: (frames, rows, cols) in patches;
        encoder_hidden_states: [B, L, text_dim], the prompt's tokens zero-padded to the pipeline's max length;
        image_latents: image-to-video's first frame [B, rows·cols, C·4] (fp32), which replaces the first latent
        frame, whose tokens then get timestep 0 (`latents.first_frame_inputs`). Returns the prediction in the same
        packed layout."""
        B, S, _ = hidden_states.shape
        if len(grid) != 3 or math.prod(grid) != S:
            raise ValueError(f"grid {tuple(grid)} (frames, rows, cols) does not hold the {S} tokens of hidden_states")
        if timestep.shape not in ((B,), (B, S)):
            raise ValueError(f"timestep {tuple(timestep.shape)} must be [B] or one per token [B, S] = [{B}, {S}]")
        if image_latents is not None:
            hidden_states, timestep = first_frame_inputs(hidden_states, timestep, image_latents)
        c = self.config
        x = self.patch_embedding(hidden_states, grid)
        tables = self.rope(grid, x.device)
        temb, proj, text = self.condition_embedder(timestep, encoder_hidden_states)
        for block in self.blocks:
            x = block(x, text, proj, tables)
        shift, scale = output_rows(self.scale_shift_table, temb)
        out = self.proj_out(self.norm_out(x, shift, scale))
        # proj_out's features are (pt, ph, pw, C) per patch (diffusers' unpatchify); the packed layout, (C, pt, ph, pw)
        return out.unflatten(-1, (c.patch_volume, c.out_channels)).transpose(-1, -2).flatten(2).contiguous()


def build_model(config: WanConfig | dict, device="cpu", dtype: torch.dtype = torch.bfloat16) -> WanTransformer:
    """An engine model with uninitialised parameters on `device` (weights come from `weights.load_weights`): `dtype`
    everywhere but where diffusers keeps fp32 (`KEEP_IN_FP32`)."""
    if isinstance(config, dict):
        config = WanConfig.from_dict(config)
    with torch.device("meta"):
        model = WanTransformer(config)
    model = model.to(dtype)
    for name, p in model.named_parameters():
        if set(KEEP_IN_FP32) & set(name.split(".")):
            p.data = p.data.float()
    return model.to_empty(device=device).eval().requires_grad_(False)
