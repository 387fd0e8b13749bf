"""`--train-kernels fused` for Qwen-Image: the train side (diffusers' `QwenImageTransformer2DModel` + PEFT, whose code
is not edited) runs the engine's eager-exact fused kernels (`kernels/triton_ops.py`, the `*_eager_bf16` kernels the
`qwen_image` patch group runs on CUDA) as autograd Functions, swapped in underneath the model.

Forward: each Function's forward is the patch group's `*_exact` function (`patches.py`): on CUDA in bf16 one Triton
kernel that rounds after every op as diffusers' eager op sequence does, so its bits are diffusers' (the kernels are
tested bitwise against those sequences); elsewhere that op sequence itself. Parity compares forwards: it stays 0.0.
Backward: analytic, PyTorch ops in fp32 (fp64 for fp64 tensors), from the saved inputs, recomputing the cheap rest
(a norm's rsqrt). It is not autograd's bf16 chain, so gradients differ from stock by bf16 roundings
(tests/test_train_kernels.py states the tolerance).

Where each Function goes (diffusers 0.42.1, `models/transformers/transformer_qwenimage.py` unless named):
- `RMSNorm.forward` (`models/normalization.py`) of every RMSNorm with a weight: `RMSNormFunction` (`txt_norm`);
- each attention's processor (`Attention.set_processor`): `FusedQwenDoubleStreamAttnProcessor`, diffusers'
  `QwenDoubleStreamAttnProcessor2_0.__call__` with the q/k RMSNorms (`norm_q`, `norm_k`, `norm_added_q`,
  `norm_added_k`), `apply_rotary_emb_qwen` and the `torch.cat` of the two streams' q (and k) as one
  `JointQKNormRopeFunction`, whose kernels write both streams' rows into one joint buffer;
- `QwenImageTransformerBlock._modulate` (a method, set on each block): `x * (1 + scale) + shift` as one
  `ScaleShiftFunction`;
- `QwenImageTransformerBlock.forward`: its four inline gated residuals `h + gate * y` can only be reached by
  replacing the forward, so `_block_forward` is a copy of it with those four lines as `GatedResidualFunction`.
What is copied or re-implemented is guarded by the sha256 of its diffusers source (`SOURCES`): `install` refuses a
diffusers whose source differs, and a test fails.
Left as diffusers runs them: the LayerNorms and the RMS variance (reductions, whose order is PyTorch's own), GEMMs,
GELU, the attention kernel, and `norm_out` (`AdaLayerNormContinuous`: one modulation per forward).

The processor stays TP-matchable (`parallel/train_match.py` subclasses it and swaps `dispatch_attention_fn` in this
module's globals, which is why it is imported by name here): install before `match_tp`.
"""

from __future__ import annotations

import hashlib
import inspect
import types
from typing import Any, cast

import diffusers
import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage import (QwenDoubleStreamAttnProcessor2_0,
                                                                  QwenImageTransformerBlock, apply_rotary_emb_qwen)
from diffusers.utils import is_torch_npu_available
from torch import nn

from ...layers.rope import RopeTables
from . import patches as P

# diffusers' code this file copies or re-implements -> the sha256 of its source (`inspect.getsource`) in the
# diffusers it was written against (0.42.1). Another version's source must be read again before the hash moves.
SOURCES: dict[str, tuple[Any, str]] = {
    "QwenDoubleStreamAttnProcessor2_0.__call__": (QwenDoubleStreamAttnProcessor2_0.__call__,
                                                  "e6dfad13458f15b376dfaa641bbd5b41669fc35f87dc030bc7be9737c1b1aed6"),
    "QwenImageTransformerBlock.forward": (QwenImageTransformerBlock.forward,
                                          "89de238db44a7a47fb3977b20366118d2108a36ecde36be2c5d2d2c33658b609"),
    "QwenImageTransformerBlock._modulate": (QwenImageTransformerBlock._modulate,
                                            "9ee78b512057d504ae89f8e48b1c8c552aa29a8c0f214b5095766a963c5454d7"),
    "apply_rotary_emb_qwen": (apply_rotary_emb_qwen,
                              "62c3cf93c5e4d4eb7814a163cf8cf1ead83dbc09bf099a0776a0f9ceea8682a4"),
    "RMSNorm.forward": (RMSNorm.forward, "ab9075d036873ac988795adb9a228b6d64cb0420123253ccb93d1d66bb323fd4"),
}
WRITTEN_AGAINST = "0.42.1"


def source_sha256(obj: Any) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def changed_sources() -> list[str]:
    """The names of `SOURCES` whose installed diffusers source is not the one this file was written against."""
    return [name for name, (obj, digest) in SOURCES.items() if source_sha256(obj) != digest]


# -- the Functions ----------------------------------------------------------------------------------------------------
# Each forward hands `*_exact` detached tensors: `kernels.use_triton` takes no tensor that requires grad (the engine's
# kernels have no backward of their own); here the Function is the backward.
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The backward's arithmetic: fp32 for bf16/fp16/fp32 tensors, fp64 for fp64 ones (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _rms_norm_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float, need_x: bool,
                       need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradient of y = n·w, n = x·r, r = (mean(x²) + eps)^-1/2 over the last dim: dw = Σ g·n over every leading
    dim; dx = r·(g·w − n·mean(g·w·n)). `g` in any dtype; the arithmetic in `_compute_dtype(x)`."""
    dt = _compute_dtype(x)
    x, g = x.to(dt), g.to(dt)
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = x * r
    dw = (g * n).sum(dim=tuple(range(x.dim() - 1))).to(w.dtype) if need_w else None
    dx = None
    if need_x:
        gw = g * w.to(dt)
        dx = r * (gw - n * (gw * n).mean(-1, keepdim=True))
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """diffusers' `RMSNorm.forward` (weight, no bias): `(x · rsqrt(mean(x²) + eps)).to(w.dtype) · w`, x [..., D]."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return P.rms_norm_exact(x.detach(), weight.detach(), eps)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, weight, eps = inputs
        ctx.save_for_backward(x, weight)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        dx, dw = _rms_norm_backward(g, x, w, ctx.eps, *ctx.needs_input_grad[:2])
        return None if dx is None else dx.to(x.dtype), dw, None


class ScaleShiftFunction(torch.autograd.Function):
    """`_modulate`'s `xn * (1 + scale[:, None]) + shift[:, None]`; xn [B, S, D] (a LayerNorm's output), shift and
    scale [B, D] (row-strided chunks of the modulation are fine)."""

    @staticmethod
    def forward(xn: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return P.scale_shift_exact(xn.detach(), shift.detach(), scale.detach())

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        xn, shift, scale = inputs
        ctx.save_for_backward(xn, scale)
        ctx.shift_dtype = shift.dtype

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        xn, scale = ctx.saved_tensors
        need_xn, need_shift, need_scale = ctx.needs_input_grad
        dt = _compute_dtype(g)
        g = g.to(dt)
        d_xn = (g * (1 + scale.to(dt))[:, None]).to(xn.dtype) if need_xn else None
        d_shift = g.sum(1).to(ctx.shift_dtype) if need_shift else None
        d_scale = (g * xn.to(dt)).sum(1).to(scale.dtype) if need_scale else None
        return d_xn, d_shift, d_scale


class GatedResidualFunction(torch.autograd.Function):
    """The block's gated residual `residual + gate[:, None] * y`; y, residual [B, S, D], gate [B, D]."""

    @staticmethod
    def forward(y: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return P.gated_residual_exact(y.detach(), gate.detach(), residual.detach())

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        y, gate, residual = inputs
        ctx.save_for_backward(y, gate)
        ctx.residual_dtype = residual.dtype

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, gate = ctx.saved_tensors
        need_y, need_gate, need_residual = ctx.needs_input_grad
        dt = _compute_dtype(g)
        g32 = g.to(dt)
        d_y = (g32 * gate.to(dt)[:, None]).to(y.dtype) if need_y else None
        d_gate = (g32 * y.to(dt)).sum(1).to(gate.dtype) if need_gate else None
        return d_y, d_gate, g.to(ctx.residual_dtype) if need_residual else None


def _rope_backward(g: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The gradient of the rotation z = y·f (pairs as complex numbers, f [S, D/2] per token): dy = g·conj(f), in
    `_compute_dtype(g)`."""
    dt = _compute_dtype(g)
    gc = torch.view_as_complex(g.to(dt).reshape(*g.shape[:-1], -1, 2).contiguous())
    f = freqs.to(torch.complex128 if dt == torch.float64 else torch.complex64)
    return torch.view_as_real(gc * f.conj().unsqueeze(1)).flatten(3)


class JointQKNormRopeFunction(torch.autograd.Function):
    """The processor's q (or k) from both streams: each stream's per-head RMSNorm (diffusers' `RMSNorm`), then its
    RoPE (`apply_rotary_emb_qwen(use_real=False)`: complex multiplication by `freqs` [S, D/2]), then
    `torch.cat([text, image], dim=1)`. txt [B, St, H, D], img [B, Si, H, D]; returns [B, St + Si, H, D]."""

    @staticmethod
    def forward(txt: torch.Tensor, img: torch.Tensor, w_txt: torch.Tensor, w_img: torch.Tensor,
                f_txt: torch.Tensor, f_img: torch.Tensor, eps_txt: float, eps_img: float) -> torch.Tensor:
        St = txt.shape[1]
        out = txt.new_empty((txt.shape[0], St + img.shape[1], *txt.shape[2:]))
        P.qk_norm_rope_exact(txt.detach(), w_txt.detach(), eps_txt, RopeTables(freqs=f_txt), out=out[:, :St])
        P.qk_norm_rope_exact(img.detach(), w_img.detach(), eps_img, RopeTables(freqs=f_img), out=out[:, St:])
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        txt, img, w_txt, w_img, f_txt, f_img, eps_txt, eps_img = inputs
        ctx.save_for_backward(txt, img, w_txt, w_img, f_txt, f_img)
        ctx.eps = (eps_txt, eps_img)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        txt, img, w_txt, w_img, f_txt, f_img = ctx.saved_tensors
        need = ctx.needs_input_grad
        St = txt.shape[1]
        streams = ((txt, w_txt, f_txt, ctx.eps[0], g[:, :St], need[0], need[2]),
                   (img, w_img, f_img, ctx.eps[1], g[:, St:], need[1], need[3]))
        (d_txt, dw_txt), (d_img, dw_img) = [_rms_norm_backward(_rope_backward(gs, f), x, w, eps, nx, nw)
                                            for x, w, f, eps, gs, nx, nw in streams]
        return (None if d_txt is None else d_txt.to(txt.dtype), None if d_img is None else d_img.to(img.dtype),
                dw_txt, dw_img, None, None, None, None)


# -- where they go in diffusers' model --------------------------------------------------------------------------------
def _rms_norm_forward(self: RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers' `RMSNorm.forward` where it has a weight and no bias (off an NPU: `install` refuses one)."""
    return RMSNormFunction.apply(hidden_states, self.weight, self.eps)


def _modulate(self: QwenImageTransformerBlock, x: torch.Tensor, mod_params: torch.Tensor, index=None):
    """diffusers' `QwenImageTransformerBlock._modulate`: `x * (1 + scale) + shift` as one `ScaleShiftFunction`, and
    the gate; with `index` (zero_cond_t's per-token choice between two modulations) diffusers' own."""
    if index is not None:
        return QwenImageTransformerBlock._modulate(self, x, mod_params, index)
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    return ScaleShiftFunction.apply(x, shift, scale), gate.unsqueeze(1)


def _gated_residual(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """diffusers' `residual + gate * y`: a gate per sample ([B, 1, D], `_modulate`'s) as one
    `GatedResidualFunction`; zero_cond_t's gate per token as diffusers' expression."""
    if gate.dim() == 3 and gate.shape[1] == 1:
        return GatedResidualFunction.apply(y, gate[:, 0], residual)
    return residual + gate * y


# Copied from diffusers.models.transformers.transformer_qwenimage.QwenImageTransformerBlock.forward (SOURCES guards
# it), the four gated residuals `h = h + gate * output` written `_gated_residual(h, gate, output)`.
def _block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    modulate_index: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Get modulation parameters for both streams
    img_mod_params = self.img_mod(temb)  # [B, 6*dim]

    if self.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_mod_params = self.txt_mod(temb)  # [B, 6*dim]

    # Split modulation parameters for norm1 and norm2
    img_mod1, img_mod2 = img_mod_params.chunk(2, dim=-1)  # Each [B, 3*dim]
    txt_mod1, txt_mod2 = txt_mod_params.chunk(2, dim=-1)  # Each [B, 3*dim]

    # Process image stream - norm1 + modulation
    img_normed = self.img_norm1(hidden_states)
    img_modulated, img_gate1 = self._modulate(img_normed, img_mod1, modulate_index)

    # Process text stream - norm1 + modulation
    txt_normed = self.txt_norm1(encoder_hidden_states)
    txt_modulated, txt_gate1 = self._modulate(txt_normed, txt_mod1)

    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(
        hidden_states=img_modulated,  # Image stream (will be processed as "sample")
        encoder_hidden_states=txt_modulated,  # Text stream (will be processed as "context")
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    # QwenAttnProcessor2_0 returns (img_output, txt_output) when encoder_hidden_states is provided
    img_attn_output, txt_attn_output = attn_output

    # Apply attention gates and add residual (like in Megatron)
    hidden_states = _gated_residual(hidden_states, img_gate1, img_attn_output)
    encoder_hidden_states = _gated_residual(encoder_hidden_states, txt_gate1, txt_attn_output)

    # Process image stream - norm2 + MLP
    img_normed2 = self.img_norm2(hidden_states)
    img_modulated2, img_gate2 = self._modulate(img_normed2, img_mod2, modulate_index)
    img_mlp_output = self.img_mlp(img_modulated2)
    hidden_states = _gated_residual(hidden_states, img_gate2, img_mlp_output)

    # Process text stream - norm2 + MLP
    txt_normed2 = self.txt_norm2(encoder_hidden_states)
    txt_modulated2, txt_gate2 = self._modulate(txt_normed2, txt_mod2)
    txt_mlp_output = self.txt_mlp(txt_modulated2)
    encoder_hidden_states = _gated_residual(encoder_hidden_states, txt_gate2, txt_mlp_output)

    # Clip to prevent overflow for fp16
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    return encoder_hidden_states, hidden_states


class FusedQwenDoubleStreamAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """diffusers' joint attention processor, its q/k norms, RoPE and [text, image] concatenation of q and k as one
    `JointQKNormRopeFunction` each (the value's concatenation stays `torch.cat`)."""

    # Copied from diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0.__call__
    # (SOURCES guards it), from "Apply QK normalization" to the q/k concatenation as two JointQKNormRopeFunction
    # calls. diffusers' model always passes its RoPE tables (QwenEmbedRope's and QwenEmbedLayer3DRope's are complex).
    def __call__(  # type: ignore[override]  # diffusers annotates a FloatTensor and returns this pair
        self,
        attn: Attention,
        hidden_states: torch.Tensor,  # Image stream
        encoder_hidden_states: torch.Tensor | None = None,  # Text stream
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,  # (image, text) tables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("QwenDoubleStreamAttnProcessor2_0 requires encoder_hidden_states (text stream)")

        if attention_mask is not None:
            raise ValueError(
                "QwenDoubleStreamAttnProcessor2_0 does not accept an external attention_mask. "
                "Pass encoder_hidden_states_mask to let the processor build the joint mask."
            )
        if image_rotary_emb is None:
            raise ValueError("the fused Qwen-Image attention processor rotates q and k: it needs image_rotary_emb")

        if encoder_hidden_states_mask is not None:
            seq_img = hidden_states.shape[1]
            image_mask = torch.ones((hidden_states.shape[0], seq_img), dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
            attention_mask = attention_mask[:, None, None, :]

        seq_txt = encoder_hidden_states.shape[1]

        # Compute QKV for image stream (sample projections)
        img_query = attn.to_q(hidden_states)
        img_key = attn.to_k(hidden_states)
        img_value = attn.to_v(hidden_states)

        # Compute QKV for text stream (context projections)
        txt_query = attn.add_q_proj(encoder_hidden_states)
        txt_key = attn.add_k_proj(encoder_hidden_states)
        txt_value = attn.add_v_proj(encoder_hidden_states)

        head_dim = attn.inner_dim // attn.heads
        img_query = img_query.unflatten(-1, (-1, head_dim))
        img_key = img_key.unflatten(-1, (-1, head_dim))
        img_value = img_value.unflatten(-1, (-1, head_dim))

        txt_query = txt_query.unflatten(-1, (-1, head_dim))
        txt_key = txt_key.unflatten(-1, (-1, head_dim))
        txt_value = txt_value.unflatten(-1, (-1, head_dim))

        # QK normalization, RoPE and the [text, image] concatenation, in one Function each
        img_freqs, txt_freqs = image_rotary_emb
        (q_txt, q_img, k_txt, k_img) = (_qk_norm(attn, n) for n in ("norm_added_q", "norm_q", "norm_added_k", "norm_k"))
        joint_query = JointQKNormRopeFunction.apply(txt_query, img_query, q_txt.weight, q_img.weight, txt_freqs,
                                                    img_freqs, q_txt.eps, q_img.eps)
        joint_key = JointQKNormRopeFunction.apply(txt_key, img_key, k_txt.weight, k_img.weight, txt_freqs, img_freqs,
                                                  k_txt.eps, k_img.eps)
        joint_value = torch.cat([txt_value, img_value], dim=1)

        joint_hidden_states = dispatch_attention_fn(
            joint_query,
            joint_key,
            joint_value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )

        # Reshape back
        joint_hidden_states = joint_hidden_states.flatten(2, 3)
        joint_hidden_states = joint_hidden_states.to(joint_query.dtype)

        # Split attention outputs back
        txt_attn_output = joint_hidden_states[:, :seq_txt, :]  # Text part
        img_attn_output = joint_hidden_states[:, seq_txt:, :]  # Image part

        # Apply output projections
        img_attn_output = attn.to_out[0](img_attn_output.contiguous())
        if len(attn.to_out) > 1:
            img_attn_output = attn.to_out[1](img_attn_output)  # dropout

        txt_attn_output = attn.to_add_out(txt_attn_output.contiguous())

        return img_attn_output, txt_attn_output


QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def _qk_norm(attn: Attention, name: str) -> RMSNorm:
    """One of the attention's q/k norms, a diffusers RMSNorm with a weight (`install` checked it)."""
    return cast(RMSNorm, getattr(attn, name))


def _takes_rms_function(norm: nn.Module | None) -> bool:
    """A diffusers RMSNorm whose forward is `RMSNormFunction`'s arithmetic: a weight, no bias."""
    return isinstance(norm, RMSNorm) and norm.weight is not None and norm.bias is None


def install(model: nn.Module) -> list[str]:
    """Swap the Functions in underneath `model` (diffusers' QwenImageTransformer2DModel, with PEFT adapters and FSDP2
    as the trainer builds it); returns `name.what` of every swap. Everything is checked before anything is swapped;
    each refusal is one line. Run it before `parallel.train_match.match_tp`, which then wraps these processors."""
    changed = changed_sources()
    if changed:
        raise ValueError(f"--train-kernels fused: diffusers {diffusers.__version__} changed {', '.join(changed)} "
                         f"since trueflow's copy (trueflow/models/qwen_image/train_kernels.py, diffusers "
                         f"{WRITTEN_AGAINST}); use --train-kernels stock")
    if getattr(model, "_trueflow_tp_match", None) is not None:
        raise ValueError("--train-kernels fused: install the train kernels before TP-matching the model (match_tp "
                         "wraps the attention processors it finds)")
    if getattr(model, "_trueflow_train_kernels", False):
        raise ValueError("--train-kernels fused: the train kernels are installed on this model already")
    if is_torch_npu_available():
        raise ValueError("--train-kernels fused: on an NPU diffusers' RMSNorm runs torch_npu's kernel, whose bits the "
                         "Functions do not reproduce; use --train-kernels stock")
    modules = list(model.named_modules())
    problems = [f"{name}: processor {type(m.processor).__name__}, not diffusers' QwenDoubleStreamAttnProcessor2_0"
                for name, m in modules if isinstance(m, Attention) and type(m.processor) is not
                QwenDoubleStreamAttnProcessor2_0]
    problems += [f"{name}.{norm}: not a diffusers RMSNorm with a weight and no bias" for name, m in modules
                 if isinstance(m, Attention) for norm in QK_NORMS if not _takes_rms_function(getattr(m, norm, None))]
    if problems:
        raise ValueError(f"--train-kernels fused cannot serve {'; '.join(problems)}; use --train-kernels stock")
    swapped = []
    for name, m in modules:
        if isinstance(m, QwenImageTransformerBlock):
            m._modulate = types.MethodType(_modulate, m)  # type: ignore[method-assign]
            m.forward = types.MethodType(_block_forward, m)  # type: ignore[method-assign]
            swapped += [f"{name}._modulate", f"{name}.forward"]
        elif _takes_rms_function(m):
            m.forward = types.MethodType(_rms_norm_forward, m)  # type: ignore[method-assign]
            swapped.append(f"{name}.forward")
        elif isinstance(m, Attention):
            fused = FusedQwenDoubleStreamAttnProcessor()
            fused.__dict__.update(m.processor.__dict__)  # the backend diffusers may have set on it
            m.set_processor(fused)  # type: ignore[arg-type]  # diffusers types processors as a union of its own
            swapped.append(f"{name}.processor")
    model._trueflow_train_kernels = True  # type: ignore[assignment]  # torch's stub: Module.__setattr__ takes only Tensor | Module
    return swapped
