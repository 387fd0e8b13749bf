"""The rollout engine's Qwen-Image transformer (MMDiT), readable top to bottom.

Built from a checkpoint's transformer config (never assuming a size); weights come from diffusers-format
tensors through `weights.py`. Its blocks are wired from the shared `trueflow.layers`, whose fast paths are a
serving engine's: packed q/k/v GEMMs, fused fp32 RMSNorm, fused LayerNorm + scale/shift and residual-gate, the fused
gated residual, fused qk-norm + RoPE from real cos/sin tables, and the timestep kept in fp32. A rollout patch group
(`patches.py`) swaps them for train-exact arithmetic. The model knows nothing of files or parallelism.
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
from ...layers.norms import RMSNorm
from ...layers.rope import QKNormRope, RopeTables, rope_tables_fused
from ..spec import EngineModel
from ...layers.timestep import TIMESTEP_CHANNELS, timestep_proj


@dataclass(frozen=True)
class QwenImageConfig:
    """The transformer's architecture, with the names of diffusers' `QwenImageTransformer2DModel` config."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)

    # Variants of the family this engine does not implement; a checkpoint that turns one on is refused.
    _UNSUPPORTED = {"guidance_embeds": False, "zero_cond_t": False, "use_additional_t_cond": False,
                    "use_layer3d_rope": False}

    @classmethod
    def from_dict(cls, config: dict) -> "QwenImageConfig":
        bad = [f"{k}={config[k]!r}" for k, ok in cls._UNSUPPORTED.items() if config.get(k, ok) != ok]
        if bad:
            raise ValueError(f"this Qwen-Image transformer config uses variants the engine does not implement: "
                             f"{', '.join(bad)}")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names}
        if "axes_dims_rope" in kwargs:
            kwargs["axes_dims_rope"] = tuple(kwargs["axes_dims_rope"])
        if kwargs.get("out_channels") is None:
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        cfg = cls(**kwargs)
        if sum(cfg.axes_dims_rope) != cfg.attention_head_dim:
            raise ValueError(f"axes_dims_rope {cfg.axes_dims_rope} must sum to attention_head_dim "
                             f"{cfg.attention_head_dim}")
        return cfg

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# -- timestep ------------------------------------------------------------------------------------------------
def timestep_proj_fused(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sinusoid of the schedule timestep `t` (fp32, 0..1000) in fp32 from the fp32 timestep (the model's /1000
    and the embedder's ·1000 cancel exactly), rounded to `dtype` once."""
    return timestep_proj(t).to(dtype)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = Linear(TIMESTEP_CHANNELS, dim)
        self.linear_2 = Linear(dim, dim)
        self.proj_impl = timestep_proj_fused

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(self.proj_impl(t, dtype))))


# -- rotary positions ----------------------------------------------------------------------------------------
def rope_positions(height: int, width: int, text_len: int, frames: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer (frame, row, column) positions of the image tokens [F·H·W, 3] and the text tokens [L, 3].

    Qwen-Image centres the image grid (rows -(H - H//2) .. H//2 - 1, same for columns) and places the text on
    the diagonal right after it, starting at max(H//2, W//2) on all three axes."""
    f = torch.arange(frames)
    h = torch.arange(height) - (height - height // 2)
    w = torch.arange(width) - (width - width // 2)
    grid = torch.stack(torch.meshgrid(f, h, w, indexing="ij"), dim=-1).reshape(-1, 3)
    start = max(height // 2, width // 2)
    text = (start + torch.arange(text_len))[:, None].expand(text_len, 3)
    return grid, text.contiguous()


class RotaryEmbedding(nn.Module):
    """Builds the rotation tables of one forward shape; `impl` chooses how (fast: fp32 on the device)."""

    def __init__(self, axes_dim: tuple[int, ...], theta: int = 10000):
        super().__init__()
        self.axes_dim, self.theta = tuple(axes_dim), theta
        self.impl = rope_tables_fused
        self._cache: dict = {}

    def forward(self, height: int, width: int, text_len: int, device) -> tuple[RopeTables, RopeTables]:
        key = (self.impl, height, width, text_len, str(device))
        if key not in self._cache:
            img_pos, txt_pos = rope_positions(height, width, text_len)
            self._cache[key] = (self.impl(img_pos, self.axes_dim, self.theta, device),
                                self.impl(txt_pos, self.axes_dim, self.theta, device))
        return self._cache[key]


# -- blocks --------------------------------------------------------------------------------------------------
class JointAttention(nn.Module):
    """Joint attention over [text, image]: packed q/k/v per stream, qk-norm + RoPE, one SDPA, split back."""

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

    def forward(self, img, txt, rope: tuple[RopeTables, RopeTables], mask: torch.Tensor | None):
        img_tables, txt_tables = rope
        iq, ik, iv = (t.unflatten(-1, (-1, self.head_dim)) for t in self.to_qkv(img))
        tq, tk, tv = (t.unflatten(-1, (-1, self.head_dim)) for t in self.add_qkv(txt))
        seq_txt = txt.shape[1]
        # The joint [text, image] q, k and v, each in one buffer laid out for the kernel: the qk-norms write their
        # rows in place, so no torch.cat copies q and k (the values are the concatenation's, bit for bit).
        q, k, v = (joint_buffer(tq, iq, self.backend) for _ in range(3))
        self.norm_added_q(tq, txt_tables, out=q[:, :seq_txt])
        self.norm_q(iq, img_tables, out=q[:, seq_txt:])
        self.norm_added_k(tk, txt_tables, out=k[:, :seq_txt])
        self.norm_k(ik, img_tables, out=k[:, seq_txt:])
        v[:, :seq_txt].copy_(tv)
        v[:, seq_txt:].copy_(iv)
        if mask is not None:  # text mask [B, L] -> joint key mask [B, L + S]
            mask = torch.cat([mask, mask.new_ones(img.shape[0], img.shape[1])], dim=1)
        out = attention(q, k, v, mask, self.backend).to(q.dtype)
        # Split, then flatten the heads: a heads-major output (cuDNN's) is copied once per stream, where diffusers'
        # flatten-then-split copies it twice; copies move bits, so the values are the same.
        txt_out, img_out = out[:, :seq_txt].flatten(2, 3), out[:, seq_txt:].flatten(2, 3)
        if self.contiguous_split:
            txt_out, img_out = txt_out.contiguous(), img_out.contiguous()
        return self.to_out(img_out), self.to_add_out(txt_out)


class TransformerBlock(nn.Module):
    """Dual-stream block. Modulation rows per stream: (shift, scale, gate) for the attention half, then for the
    MLP half."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.img_mod = Linear(dim, 6 * dim)
        self.txt_mod = Linear(dim, 6 * dim)
        self.img_norm1, self.txt_norm1 = LayerNormScaleShift(eps), LayerNormScaleShift(eps)
        self.attn = JointAttention(dim, heads, head_dim, eps)
        self.img_norm2 = ScaleResidualLayerNormScaleShift(eps)
        self.txt_norm2 = ScaleResidualLayerNormScaleShift(eps)
        self.img_mlp, self.txt_mlp = FeedForward(dim, 4 * dim), FeedForward(dim, 4 * dim)
        self.img_gate_add, self.txt_gate_add = GatedResidual(), GatedResidual()

    def forward(self, img, txt, temb_act, rope, mask):
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = self.img_mod(temb_act).chunk(6, dim=-1)
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt_mod(temb_act).chunk(6, dim=-1)
        img_attn, txt_attn = self.attn(self.img_norm1(img, i_shift1, i_scale1),
                                       self.txt_norm1(txt, t_shift1, t_scale1), rope, mask)
        img, img_x = self.img_norm2(img, img_attn, i_gate1, i_shift2, i_scale2)
        txt, txt_x = self.txt_norm2(txt, txt_attn, t_gate1, t_shift2, t_scale2)
        img = self.img_gate_add(self.img_mlp(img_x), i_gate2, img)
        txt = self.txt_gate_add(self.txt_mlp(txt_x), t_gate2, txt)
        return txt, img  # diffusers' order: (encoder_hidden_states, hidden_states)


class OutputNorm(nn.Module):
    """Final adaLN; its modulation chunks as (scale, shift), unlike the blocks' (shift, scale, gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.linear = Linear(dim, 2 * dim)
        self.norm = LayerNormScaleShift(eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=-1)
        return self.norm(x, shift, scale)


class QwenImageTransformer(EngineModel):
    def __init__(self, config: QwenImageConfig):
        super().__init__()
        self.config = c = config
        dim = c.inner_dim
        self.rope = RotaryEmbedding(c.axes_dims_rope)
        self.time_text_embed = TimestepEmbedding(dim)
        self.txt_norm = RMSNorm(c.joint_attention_dim)
        self.img_in = Linear(c.in_channels, dim)
        self.txt_in = Linear(c.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(dim, c.num_attention_heads, c.attention_head_dim) for _ in range(c.num_layers))
        self.norm_out = OutputNorm(dim)
        self.proj_out = Linear(dim, c.patch_size * c.patch_size * c.out_channels)
        self.lora_merge = True  # fast default: a LoRA update is folded into the weights

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        grid: tuple[int, int],
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states: packed latents [B, H·W, C]; encoder_hidden_states: [B, L, joint_dim]; timestep: [B]
        fp32 schedule timesteps (0..1000; the model's own timestep path decides how it is scaled and rounded);
        grid: (H, W) in patches; mask: bool [B, L] or None (all tokens valid)."""
        img = self.img_in(hidden_states)
        txt = self.txt_in(self.txt_norm(encoder_hidden_states))
        temb = self.time_text_embed(timestep, img.dtype)
        temb_act = F.silu(temb)  # every block's modulation reads SiLU(temb); computed once
        rope = self.rope(grid[0], grid[1], txt.shape[1], img.device)
        for block in self.transformer_blocks:
            txt, img = block(img, txt, temb_act, rope, encoder_hidden_states_mask)
        return self.proj_out(self.norm_out(img, temb))


def build_model(config: QwenImageConfig | dict, device="cpu",
                dtype: torch.dtype = torch.bfloat16) -> QwenImageTransformer:
    """An engine model with uninitialised parameters on `device` (weights come from `weights.load_weights`)."""
    if isinstance(config, dict):
        config = QwenImageConfig.from_dict(config)
    with torch.device("meta"):
        model = QwenImageTransformer(config)
    return model.to(dtype).to_empty(device=device).eval().requires_grad_(False)
