"""Maps diffusers' `WanTransformer3DModel` tensor names onto the engine's parameters.

The same map serves full weights and LoRA module names, so a LoRA trained with PEFT on diffusers' model lands on the
right engine layer (and on the right slot of a packed q/k/v or k/v weight); `trueflow.models.weight_map` does the
checked, all-or-nothing loading with it. Blocks are diffusers' `blocks.N.`.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import weight_map
from ..weight_map import WeightLoadError, parse_peft_state_dict

__all__ = ["WeightLoadError", "diffusers_module_name", "load_weights", "map_module_name", "parse_peft_state_dict",
           "set_lora"]

BLOCKS = "blocks"

# diffusers module name -> (engine module name, packed slot or None); names not listed are the same on both sides.
# Inside a block (the "blocks.N." prefix is kept): q/k/v of the self-attention in one GEMM, k/v of the text in one.
_BLOCK_RENAMES: dict[str, tuple[str, int | None]] = {
    "attn1.to_q": ("attn1.to_qkv", 0), "attn1.to_k": ("attn1.to_qkv", 1), "attn1.to_v": ("attn1.to_qkv", 2),
    "attn1.to_out.0": ("attn1.to_out", None),
    "attn2.to_k": ("attn2.to_kv", 0), "attn2.to_v": ("attn2.to_kv", 1), "attn2.to_out.0": ("attn2.to_out", None),
    "ffn.net.0.proj": ("ffn.proj_in", None), "ffn.net.2": ("ffn.proj_out", None),
}
_TOP_RENAMES: dict[str, tuple[str, int | None]] = {
    "condition_embedder.text_embedder.linear_1": ("condition_embedder.text_embedder.proj_in", None),
    "condition_embedder.text_embedder.linear_2": ("condition_embedder.text_embedder.proj_out", None),
}
NAMES = weight_map.renamed({}, _TOP_RENAMES, lists={BLOCKS: _BLOCK_RENAMES})
map_module_name, diffusers_module_name = NAMES  # diffusers module -> (engine module, packed slot), and back


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """`weight_map.load_weights` with Wan's names (each tensor cast to its engine parameter's dtype: fp32 where
    diffusers keeps fp32, `transformer.KEEP_IN_FP32`)."""
    weight_map.load_weights(model, state_dict, NAMES)


def set_lora(model: nn.Module, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, merge: bool,
             check_only: bool = False) -> None:
    """`weight_map.set_lora` with Wan's names."""
    weight_map.set_lora(model, lora, scale, merge, NAMES, check_only)
