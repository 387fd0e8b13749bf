"""Maps diffusers' `LTX2VideoTransformer3DModel` tensor names onto the engine's video-stream parameters.

The same map serves full weights and LoRA module names, so a LoRA trained with PEFT on diffusers' model lands on
the right engine layer (and on the right slot of a packed q/k/v/gate weight); `trueflow.models.weight_map` does the
checked, all-or-nothing loading with it.

The engine holds the video stream only (see transformer.py): the audio stream's tensors and those of the
audio-to-video / video-to-audio attentions (`is_audio_only`) are read by nothing with the modalities isolated, so
loading skips them, and a LoRA on them is skipped too (it cannot change the video output).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .. import weight_map
from ..weight_map import WeightLoadError, parse_peft_state_dict

__all__ = ["WeightLoadError", "diffusers_module_name", "is_audio_only", "load_weights", "map_module_name",
           "parse_peft_state_dict", "set_lora"]

# diffusers module name -> (engine module name, packed slot or None); names not listed are the same on both sides.
# Inside a block (the "transformer_blocks.N." prefix is kept). The gate logits share the packed GEMM of the
# projections that read the same input: q/k/v in self-attention, q in the text attention.
_BLOCK_RENAMES: dict[str, tuple[str, int | None]] = {
    "attn1.to_q": ("attn1.to_qkv", 0), "attn1.to_k": ("attn1.to_qkv", 1), "attn1.to_v": ("attn1.to_qkv", 2),
    "attn1.to_gate_logits": ("attn1.to_qkv", 3), "attn1.to_out.0": ("attn1.to_out", None),
    "attn2.to_q": ("attn2.to_q_gate", 0), "attn2.to_gate_logits": ("attn2.to_q_gate", 1),
    "attn2.to_k": ("attn2.to_kv", 0), "attn2.to_v": ("attn2.to_kv", 1), "attn2.to_out.0": ("attn2.to_out", None),
    "ff.net.0.proj": ("ff.proj_in", None), "ff.net.2": ("ff.proj_out", None),
}
_TOP_RENAMES: dict[str, tuple[str, int | None]] = {
    f"{emb}.emb.timestep_embedder.{lin}": (f"{emb}.{lin}", None)
    for emb in ("time_embed", "prompt_adaln") for lin in ("linear_1", "linear_2")
}
# Without gated attention the text attention's q layer is not packed (one split, slot None when named by the engine).
NAMES = weight_map.renamed(_BLOCK_RENAMES, _TOP_RENAMES, {("attn2.to_q_gate", None): "attn2.to_q"})
map_module_name, diffusers_module_name = NAMES  # diffusers module -> (engine module, packed slot), and back

# The audio stream and the cross-modal attentions, top level and inside a block.
_AUDIO_TOP = re.compile(r"^(audio_|av_cross_attn_)")
_AUDIO_BLOCK = re.compile(r"^(audio_|video_to_audio_|video_a2v_cross_attn_scale_shift_table$)")


def is_audio_only(diffusers_name: str) -> bool:
    """Whether a diffusers tensor or module name belongs to the audio stream or to a cross-modal attention (the
    audio-to-video attention `audio_to_video_*` included: its query is video, but isolation turns it off)."""
    m = weight_map.BLOCK.match(diffusers_name)
    return bool(_AUDIO_BLOCK.match(m.group(2)) if m else _AUDIO_TOP.match(diffusers_name))


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """`weight_map.load_weights` with LTX-2's names, the audio-only tensors (`is_audio_only`) left out: all or
    nothing over the video stream's tensors."""
    weight_map.load_weights(model, weight_map.subset(state_dict, lambda k: not is_audio_only(k)), NAMES)


def set_lora(model: nn.Module, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, merge: bool,
             check_only: bool = False) -> None:
    """`weight_map.set_lora` with LTX-2's names; adapters on audio-only modules are skipped (the isolated video
    output does not read them)."""
    weight_map.set_lora(model, {k: v for k, v in lora.items() if not is_audio_only(k)}, scale, merge, NAMES, check_only)
