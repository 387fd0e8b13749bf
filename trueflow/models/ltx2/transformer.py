"""The rollout engine's LTX-2.3 video transformer, readable top to bottom.

LTX-2.3 (diffusers' `LTX2VideoTransformer3DModel` with gated attention, cross-attention modulation, split RoPE in
double precision and no caption projection) is an audio-video model. The train side calls it with
`isolate_modalities=True`, which turns off the audio-to-video and video-to-audio attentions of every block: the
video output then reads nothing of the audio stream (its latents, text, timestep or weights), so this engine holds
and computes the video stream only. Isolated video is off the model's joint audio-video distribution: the pipeline's
main pass runs with the modalities joined.

Built from a checkpoint's transformer config (never assuming a size); weights come from diffusers-format tensors
through `weights.py`. Its blocks are wired from the shared `trueflow.layers`, whose fast paths are a serving
engine's: one packed GEMM for q/k/v and the attention gate, fused fp32 RMSNorm + modulation, fused gated residuals,
fused qk-norm + RoPE; its own are the fp32 RoPE tables and the text mask left out when every token is valid. The
`ltx` patch group (`patches.py`) swaps them for train-exact arithmetic. The model knows nothing of files or
parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ...layers.attention import attention
from ...layers.feed_forward import FeedForward
from ...layers.linear import Linear
from ...layers.modulation import AttentionGate, GatedResidual, LayerNormScaleShift, RMSNormScaleShift, ScaleShift
from ...layers.rope import QKNormAcrossHeadsRope, RopeTables
from ..spec import EngineModel
from ...layers.timestep import TIMESTEP_CHANNELS, timestep_proj


@dataclass(frozen=True)
class LTX2Config:
    """The video stream's architecture, with the names (and defaults) of diffusers' `LTX2VideoTransformer3DModel`
    config; the audio keys are read by nothing here."""

    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    num_layers: int = 48
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    use_prompt_embeddings: bool = True
    ff_bias: bool = True

    # Variants of the family this engine does not implement (key: the value it requires); a checkpoint that sets
    # another value is refused. The 2.0 interleaved RoPE and the 2.5 cacheable prompt modulation are other models.
    _REQUIRED = {"rope_type": "split", "qk_norm": "rms_norm_across_heads", "activation_fn": "gelu-approximate",
                 "norm_elementwise_affine": False, "use_prompt_adaln_single": True,
                 "use_keyframes_abs_pos_embedding": False, "patch_size": 1, "patch_size_t": 1}
    _DIFFUSERS_DEFAULTS = {"rope_type": "interleaved"}  # required keys whose diffusers default differs

    @classmethod
    def from_dict(cls, config: dict) -> "LTX2Config":
        bad = [f"{k}={config.get(k, cls._DIFFUSERS_DEFAULTS.get(k, want))!r} (needs {want!r})"
               for k, want in cls._REQUIRED.items() if config.get(k, cls._DIFFUSERS_DEFAULTS.get(k, want)) != want]
        if bad:
            raise ValueError(f"this LTX-2 transformer config uses variants the engine does not implement: "
                             f"{', '.join(bad)}")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        if "vae_scale_factors" in kwargs:
            kwargs["vae_scale_factors"] = tuple(kwargs["vae_scale_factors"])
        if kwargs.get("out_channels") is None:
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        cfg = cls(**kwargs)
        if cfg.attention_head_dim % 2:
            raise ValueError(f"attention_head_dim {cfg.attention_head_dim} must be even for the split RoPE")
        if cfg.cross_attn_mod and cfg.cross_attention_dim != cfg.inner_dim:
            raise ValueError(f"cross_attention_dim {cfg.cross_attention_dim} must equal the video width "
                             f"{cfg.inner_dim} with cross_attn_mod: the text is modulated by the video's rows")
        return cfg

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# -- timestep ------------------------------------------------------------------------------------------------
class AdaLNSingle(nn.Module):
    """diffusers' `LTX2AdaLayerNormSingle`: the timestep embedding (`linear_2(SiLU(linear_1(proj(t))))`, the
    timestep as the pipeline passes it, fp32 0..1000, unrounded) and the `n` modulation rows computed from it
    (`linear(SiLU(emb))`)."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.linear_1 = Linear(TIMESTEP_CHANNELS, dim)
        self.linear_2 = Linear(dim, dim)
        self.linear = Linear(dim, n * dim)

    def forward(self, t: torch.Tensor, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """t: [B] or [B, S] -> (modulation [B, 1 or S, n·dim], embedding [B, 1 or S, dim])."""
        emb = self.linear_2(F.silu(self.linear_1(timestep_proj(t.flatten()).to(dtype))))
        mod = self.linear(F.silu(emb))
        return mod.view(batch, -1, mod.shape[-1]), emb.view(batch, -1, emb.shape[-1])


def mod_params(table: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """diffusers' `get_mod_params`: a block's table [n, D] plus the timestep rows [B, T, n·D], split into n tensors
    [B, T, D] (the sum in the model dtype on both sides)."""
    B, T, _ = temb.shape
    return (table[None, None] + temb.reshape(B, T, table.shape[0], -1)).unbind(dim=2)


# -- rotary positions ----------------------------------------------------------------------------------------
def video_positions(config: LTX2Config, grid: tuple[int, int, int], fps: float, device) -> torch.Tensor:
    """Each token's (frame, row, column) position as a fraction of the model's base sizes, [S, 3] fp32: the centre of
    its pixel footprint, the frame axis in seconds with the causal first frame (stride 1, not the VAE's temporal
    factor), computed in closed form."""
    frames, rows, cols = grid
    ft, fh, fw = config.vae_scale_factors
    f = torch.arange(frames, device=device, dtype=torch.float32)
    start = (f * ft + (config.causal_offset - ft)).clamp(min=0)
    end = ((f + 1) * ft + (config.causal_offset - ft)).clamp(min=0)
    pf = (start + end) / (2 * fps * config.pos_embed_max_pos)
    ph = (torch.arange(rows, device=device, dtype=torch.float32) + 0.5) * (fh / config.base_height)
    pw = (torch.arange(cols, device=device, dtype=torch.float32) + 0.5) * (fw / config.base_width)
    mesh = torch.meshgrid(pf, ph, pw, indexing="ij")
    return torch.stack(mesh, dim=-1).reshape(-1, 3)


def split_tables(angles: torch.Tensor, inner_dim: int, heads: int) -> RopeTables:
    """Angles [S, n·3] (frequency-major: each frequency's three axes together) -> split-RoPE tables, cos and sin per
    head [1, H, S, D/2] (fp32), the first `inner_dim/2 - 3n` channels padded with the identity rotation."""
    pad = inner_dim // 2 - angles.shape[-1]
    cos, sin = angles.cos(), angles.sin()
    if pad:
        cos = torch.cat([torch.ones_like(cos[:, :pad]), cos], dim=-1)
        sin = torch.cat([torch.zeros_like(sin[:, :pad]), sin], dim=-1)
    S = angles.shape[0]
    cos, sin = (t.reshape(S, heads, -1).transpose(0, 1).unsqueeze(0) for t in (cos, sin))
    return RopeTables(cos=cos, sin=sin, pairs="split")


def rope_tables_fused(config: LTX2Config, grid: tuple[int, int, int], fps: float, device) -> RopeTables:
    """The video self-attention's RoPE tables in fp32 on the device: `θ^linspace(0, 1, n)·π/2` per frequency,
    times `2·position - 1` per axis."""
    n = config.inner_dim // 6
    freqs = torch.pow(torch.tensor(config.rope_theta, device=device, dtype=torch.float32),
                      torch.linspace(0.0, 1.0, n, device=device, dtype=torch.float32)) * (math.pi / 2)
    pos = video_positions(config, grid, fps, device)
    angles = ((pos * 2 - 1)[:, :, None] * freqs).transpose(-1, -2).flatten(1)
    return split_tables(angles, config.inner_dim, config.num_attention_heads)


class RotaryEmbedding(nn.Module):
    """The tables of one grid and frame rate (cached); `impl` chooses how they are computed."""

    def __init__(self, config: LTX2Config):
        super().__init__()
        self.config = config
        self.impl: Callable[..., RopeTables] = rope_tables_fused  # a patch group may swap it
        self._cache: dict = {}

    def forward(self, grid: tuple[int, int, int], fps: float, device) -> RopeTables:
        key = (self.impl, tuple(grid), float(fps), str(device))
        if key not in self._cache:
            self._cache[key] = self.impl(self.config, tuple(grid), float(fps), device)
        return self._cache[key]


# -- blocks --------------------------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    """Video self-attention: q, k, v (and the per-head gate logits) from one packed GEMM, qk-norm + RoPE, SDPA, the
    gate, the output projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, gated: bool, bias: bool, out_bias: bool, eps: float):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.gated = heads, gated
        splits = (inner, inner, inner) + ((heads,) if gated else ())
        self.to_qkv = Linear(dim, sum(splits), bias=bias, splits=splits)
        self.norm_q, self.norm_k = QKNormAcrossHeadsRope(inner, heads, eps), QKNormAcrossHeadsRope(inner, heads, eps)
        self.gate = AttentionGate()
        self.to_out = Linear(inner, dim, bias=out_bias)
        self.backend = "sdpa"

    def forward(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        q, k, v, *logits = self.to_qkv(x)
        out = attention(self.norm_q(q, tables), self.norm_k(k, tables), v.unflatten(-1, (self.heads, -1)), None,
                        self.backend)
        if self.gated:
            out = self.gate(out, logits[0])
        return self.to_out(out.flatten(2, 3))


class CrossAttention(nn.Module):
    """Video-to-text attention: q (and the gate logits) from the video tokens in one GEMM, k and v from the text in
    another, qk-norm without RoPE, SDPA with the text mask, the gate, the output projection."""

    def __init__(self, dim: int, cross_dim: int, heads: int, head_dim: int, gated: bool, bias: bool, out_bias: bool,
                 eps: float):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.gated = heads, gated
        splits = (inner,) + ((heads,) if gated else ())
        self.to_q_gate = Linear(dim, sum(splits), bias=bias, splits=splits)
        self.to_kv = Linear(cross_dim, 2 * inner, bias=bias, splits=(inner, inner))
        self.norm_q, self.norm_k = QKNormAcrossHeadsRope(inner, heads, eps), QKNormAcrossHeadsRope(inner, heads, eps)
        self.gate = AttentionGate()
        self.to_out = Linear(inner, dim, bias=out_bias)
        self.backend = "sdpa"

    def forward(self, x: torch.Tensor, text: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, *logits = self.to_q_gate(x) if self.gated else (self.to_q_gate(x),)
        k, v = self.to_kv(text)
        out = attention(self.norm_q(q, None), self.norm_k(k, None), v.unflatten(-1, (self.heads, -1)), mask,
                        self.backend)
        if self.gated:
            out = self.gate(out, logits[0])
        return self.to_out(out.flatten(2, 3))


class TransformerBlock(nn.Module):
    """The video half of diffusers' `LTX2VideoTransformerBlock` (the audio half and the cross-modal attentions are
    off under `isolate_modalities=True`). Modulation rows: (shift, scale, gate) for self-attention, then for the
    MLP, then (with cross-attention modulation) for the text attention's query; the text's key/value rows come from
    the prompt timestep."""

    def __init__(self, c: LTX2Config):
        super().__init__()
        dim, eps = c.inner_dim, c.norm_eps
        self.cross_attn_mod = c.cross_attn_mod
        self.scale_shift_table = nn.Parameter(torch.empty(9 if c.cross_attn_mod else 6, dim))
        if c.cross_attn_mod:
            self.prompt_scale_shift_table = nn.Parameter(torch.empty(2, dim))
        self.norm1, self.norm2, self.norm3 = RMSNormScaleShift(eps), RMSNormScaleShift(eps), RMSNormScaleShift(eps)
        self.attn1 = SelfAttention(dim, c.num_attention_heads, c.attention_head_dim, c.gated_attn, c.attention_bias,
                                   c.attention_out_bias, eps)
        self.attn2 = CrossAttention(dim, c.cross_attention_dim, c.num_attention_heads, c.attention_head_dim,
                                    c.gated_attn, c.attention_bias, c.attention_out_bias, eps)
        self.text_mod = ScaleShift()
        self.attn1_residual, self.attn2_residual, self.ff_residual = GatedResidual(), GatedResidual(), GatedResidual()
        self.ff = FeedForward(dim, 4 * dim, bias=c.ff_bias)

    def forward(self, x, text, temb, temb_prompt, tables, text_mask) -> torch.Tensor:
        params = mod_params(self.scale_shift_table, temb)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = params[:6]
        x = self.attn1_residual(self.attn1(self.norm1(x, shift_msa, scale_msa), tables), gate_msa, x)
        if self.cross_attn_mod:
            shift_q, scale_q, gate_q = params[6:9]
            shift_kv, scale_kv = mod_params(self.prompt_scale_shift_table, temb_prompt)
            out = self.attn2(self.norm2(x, shift_q, scale_q), self.text_mod(text, shift_kv, scale_kv), text_mask)
            x = self.attn2_residual(out, gate_q, x)
        else:
            x = x + self.attn2(self.norm2(x), text, text_mask)
        return self.ff_residual(self.ff(self.norm3(x, shift_mlp, scale_mlp)), gate_mlp, x)


class CaptionProjection(nn.Module):
    """LTX-2.0's caption projection (`PixArtAlphaTextProjection`); LTX-2.3 projects in its connectors instead."""

    def __init__(self, in_features: int, dim: int):
        super().__init__()
        self.linear_1 = Linear(in_features, dim)
        self.linear_2 = Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


# The audio stream's inputs and switches, which the video output does not read with the modalities isolated (the
# only way the engine runs): accepted so a train-side call's keywords can be passed as they are, and ignored.
AUDIO_INPUTS = frozenset({"audio_hidden_states", "audio_encoder_hidden_states", "audio_encoder_attention_mask",
                          "audio_timestep", "audio_sigma", "audio_num_frames", "audio_coords", "use_cross_timestep"})


class LTX2Transformer(EngineModel):
    def __init__(self, config: LTX2Config):
        super().__init__()
        self.config = c = config
        dim = c.inner_dim
        self.rope = RotaryEmbedding(c)
        self.proj_in = Linear(c.in_channels, dim)
        if c.use_prompt_embeddings:
            self.caption_projection = CaptionProjection(c.caption_channels, dim)
        self.time_embed = AdaLNSingle(dim, 9 if c.cross_attn_mod else 6)
        if c.cross_attn_mod:
            self.prompt_adaln = AdaLNSingle(dim, 2)
        self.transformer_blocks = nn.ModuleList(TransformerBlock(c) for _ in range(c.num_layers))
        self.scale_shift_table = nn.Parameter(torch.empty(2, dim))
        self.norm_out = LayerNormScaleShift(1e-6)
        assert c.out_channels is not None  # `LTX2Config.from_dict` fills it
        self.proj_out = Linear(dim, c.out_channels)
        self.lora_merge = True  # fast default: a LoRA update is folded into the weights
        self.text_mask_bias = False  # fast default: no mask when every text token is valid, else a bool mask

    def text_mask(self, mask: torch.Tensor | None, batch: int, text_len: int, dtype, device) -> torch.Tensor | None:
        """The text attention's mask. Fast: None when every token is valid (the collate's None: no mask for the
        kernel to read), else a bool key mask [B, 1, 1, L]. With `text_mask_bias` (the pipeline's way,
        `patches.py`): the additive bias diffusers makes of the mask, `(1 - m)·-10000` in the model dtype, repeated
        per head of the text attention that reads it [B, H, 1, L], from an all-ones mask when none is given (the
        pipeline always passes one)."""
        if not self.text_mask_bias:
            return None if mask is None else mask.bool()[:, None, None, :]
        blocks = self.transformer_blocks
        # the ModuleList holds TransformerBlocks (nn.ModuleList types its items as modules)
        heads = cast(TransformerBlock, blocks[0]).attn2.heads if len(blocks) else self.config.num_attention_heads
        m = torch.ones(batch, text_len, device=device, dtype=dtype) if mask is None else mask
        bias = ((1 - m.to(dtype)) * -10000.0).unsqueeze(1)
        return bias.repeat_interleave(heads, dim=0).view(batch, heads, -1, text_len)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        grid: tuple[int, int, int],
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        sigma: torch.Tensor | None = None,
        fps: float = 24.0,
        isolate_modalities: bool = True,
        **audio,
    ) -> torch.Tensor:
        """hidden_states: packed video latents [B, F·H·W, C]; timestep: fp32 schedule timesteps [B] or per token
        [B, S] (0..1000, as the pipeline passes them); grid: (frames, rows, cols) in latent tokens;
        encoder_hidden_states: the video text stream [B, L, cross_attention_dim] (LTX-2.3: the connectors' output);
        encoder_attention_mask: [B, L] (1 = valid) or None (all valid); sigma: the prompt modulation's timestep [B]
        (the pipeline passes the timestep itself, the default); fps: the frame rate the RoPE positions are in.
        Audio inputs (`AUDIO_INPUTS`) are ignored: the modalities are isolated."""
        unknown = sorted(set(audio) - AUDIO_INPUTS)
        if unknown:
            raise TypeError(f"LTX2Transformer.forward() got unexpected keyword arguments: {', '.join(unknown)}")
        if not isolate_modalities:
            raise ValueError("the engine runs LTX-2 with the modalities isolated (isolate_modalities=True): it holds "
                             "no audio stream")
        B, S, _ = hidden_states.shape
        if len(grid) != 3 or math.prod(grid) != S:
            raise ValueError(f"grid {tuple(grid)} (frames, rows, cols) does not hold the {S} tokens of hidden_states")
        if sigma is None:
            if timestep.dim() != 1:
                raise ValueError("per-token timesteps need `sigma` [B] for the prompt modulation")
            sigma = timestep
        x = self.proj_in(hidden_states)
        tables = self.rope(grid, fps, x.device)
        temb, embedded = self.time_embed(timestep, B, x.dtype)
        temb_prompt = self.prompt_adaln(sigma, B, x.dtype)[0] if self.config.cross_attn_mod else None
        text = self.caption_projection(encoder_hidden_states) if self.config.use_prompt_embeddings \
            else encoder_hidden_states
        mask = self.text_mask(encoder_attention_mask, B, text.shape[1], x.dtype, x.device)
        for block in self.transformer_blocks:
            x = block(x, text, temb, temb_prompt, tables, mask)
        shift, scale = (self.scale_shift_table[None, None] + embedded[:, :, None]).unbind(dim=2)
        return self.proj_out(self.norm_out(x, shift, scale))


def build_model(config: LTX2Config | dict, device="cpu", dtype: torch.dtype = torch.bfloat16) -> LTX2Transformer:
    """An engine model with uninitialised parameters on `device` (weights come from `weights.load_weights`)."""
    if isinstance(config, dict):
        config = LTX2Config.from_dict(config)
    with torch.device("meta"):
        model = LTX2Transformer(config)
    return model.to(dtype).to_empty(device=device).eval().requires_grad_(False)
