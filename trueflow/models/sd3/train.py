"""The train side's call of diffusers' `SD3Transformer2DModel`, as `StableDiffusion3Pipeline.__call__` makes it. No
diffusers import: the model arrives built (the family names its class; trueflow/train loads it).

The pipeline's call (diffusers 0.42.1): `hidden_states` the `[B, C, h, w]` latents in the pipeline's dtype (with CFG
`torch.cat([latents] * 2)`), `timestep` the fp32 schedule timestep `t.expand(B)` (0..1000, whatever the model dtype:
the embedding's sinusoid is fp32), `encoder_hidden_states` and `pooled_projections` from `encode_prompt` (with CFG
`torch.cat([negative, positive])`), no `joint_attention_kwargs`, no skip layers. The engine records latents packed
(`latents.pack_latents`); they are unpacked here (a permutation) and made contiguous, as the pipeline's are: a conv on
a strided input can take another kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from .latents import pack_latents, unpack_latents

# flow_grpo's SD3 LoRA targets (yifan123/flow_grpo, scripts/train_sd3.py): the joint attention's eight projections.
# PEFT matches each as a suffix after a dot, so `attn.to_q` leaves MMDiT-X's image-only `attn2.to_q` alone.
LORA_TARGETS: tuple[str, ...] = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                                 "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")
SHARD_UNITS: tuple[str, ...] = ("transformer_blocks",)  # each block one FSDP unit, the rest one more


def train_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the pipeline passes as `timestep` for schedule timestep t: t itself, fp32, whatever the model dtype."""
    return t.to(torch.float32)


def train_forward(model: nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor, grid: tuple[int, int],
                  cond: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """The prediction packed as the latents are, for packed latents `hidden_states` `[B, S, 4C]` (in the model
    dtype), `timestep` = `train_timestep(t)` (`[B]`), `grid` = (rows, cols) patches and `cond` from `encode_prompts`
    (collated)."""
    out = model(hidden_states=unpack_latents(hidden_states, grid).contiguous(), timestep=timestep,
                encoder_hidden_states=cond["encoder_hidden_states"], pooled_projections=cond["pooled_projections"],
                return_dict=False)[0]
    return pack_latents(out)
