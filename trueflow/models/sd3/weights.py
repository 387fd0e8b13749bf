"""Maps diffusers' `SD3Transformer2DModel` tensor names onto the engine's parameters.

The same map serves full weights and LoRA module names, so a LoRA trained with PEFT on diffusers' model lands on the
right engine layer (and on the right slot of a packed q/k/v weight); `trueflow.models.weight_map` does the checked,
all-or-nothing loading with it. The patch embedding's conv weight and the position table (a persistent buffer in
diffusers, saved with the weights) keep their diffusers names.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import weight_map
from ..weight_map import WeightLoadError, parse_peft_state_dict

__all__ = ["WeightLoadError", "diffusers_module_name", "load_weights", "map_module_name", "parse_peft_state_dict",
           "set_lora"]

# diffusers module name -> (engine module name, packed slot or None); names not listed are the same on both sides.
# Inside a block (the "transformer_blocks.N." prefix is kept): both attentions' q/k/v packed per stream.
_BLOCK_RENAMES: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("attn.to_qkv", 0), "attn.to_k": ("attn.to_qkv", 1), "attn.to_v": ("attn.to_qkv", 2),
    "attn.add_q_proj": ("attn.add_qkv", 0), "attn.add_k_proj": ("attn.add_qkv", 1),
    "attn.add_v_proj": ("attn.add_qkv", 2), "attn.to_out.0": ("attn.to_out", None),
    "attn2.to_q": ("attn2.to_qkv", 0), "attn2.to_k": ("attn2.to_qkv", 1), "attn2.to_v": ("attn2.to_qkv", 2),
    "attn2.to_out.0": ("attn2.to_out", None),
    "ff.net.0.proj": ("ff.proj_in", None), "ff.net.2": ("ff.proj_out", None),
    "ff_context.net.0.proj": ("ff_context.proj_in", None), "ff_context.net.2": ("ff_context.proj_out", None),
}
NAMES = weight_map.renamed(_BLOCK_RENAMES, {})
map_module_name, diffusers_module_name = NAMES  # diffusers module -> (engine module, packed slot), and back


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """`weight_map.load_weights` with SD3's names."""
    weight_map.load_weights(model, state_dict, NAMES)


def set_lora(model: nn.Module, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, merge: bool,
             check_only: bool = False) -> None:
    """`weight_map.set_lora` with SD3's names."""
    weight_map.set_lora(model, lora, scale, merge, NAMES, check_only)
