"""Maps diffusers' `QwenImageTransformer2DModel` tensor names onto the engine's parameters.

The same map serves full weights and LoRA module names, so a LoRA trained with PEFT on diffusers' model lands on
the right engine layer (and on the right slot of a packed q/k/v weight); `trueflow.models.weight_map` does the
checked loading with it.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import weight_map
from ..weight_map import WeightLoadError, parse_peft_state_dict

__all__ = ["WeightLoadError", "diffusers_module_name", "load_weights", "map_module_name", "parse_peft_state_dict",
           "set_lora"]

# diffusers module name -> (engine module name, packed slot or None); names not listed are the same on both sides.
# Inside a block (the "transformer_blocks.N." prefix is kept):
_BLOCK_RENAMES: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("attn.to_qkv", 0), "attn.to_k": ("attn.to_qkv", 1), "attn.to_v": ("attn.to_qkv", 2),
    "attn.add_q_proj": ("attn.add_qkv", 0), "attn.add_k_proj": ("attn.add_qkv", 1),
    "attn.add_v_proj": ("attn.add_qkv", 2),
    "attn.to_out.0": ("attn.to_out", None),
    "img_mlp.net.0.proj": ("img_mlp.proj_in", None), "img_mlp.net.2": ("img_mlp.proj_out", None),
    "txt_mlp.net.0.proj": ("txt_mlp.proj_in", None), "txt_mlp.net.2": ("txt_mlp.proj_out", None),
    "img_mod.1": ("img_mod", None), "txt_mod.1": ("txt_mod", None),
}
_TOP_RENAMES: dict[str, tuple[str, int | None]] = {
    "time_text_embed.timestep_embedder.linear_1": ("time_text_embed.linear_1", None),
    "time_text_embed.timestep_embedder.linear_2": ("time_text_embed.linear_2", None),
}
NAMES = weight_map.renamed(_BLOCK_RENAMES, _TOP_RENAMES)
map_module_name, diffusers_module_name = NAMES  # diffusers module -> (engine module, packed slot), and back


def _expected_tensors(model: nn.Module) -> dict[str, tuple[nn.Parameter, slice | None]]:
    return weight_map.expected_tensors(model, NAMES)


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """`weight_map.load_weights` with Qwen-Image's names."""
    weight_map.load_weights(model, state_dict, NAMES)


def set_lora(model: nn.Module, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, merge: bool,
             check_only: bool = False) -> None:
    """`weight_map.set_lora` with Qwen-Image's names."""
    weight_map.set_lora(model, lora, scale, merge, NAMES, check_only)
