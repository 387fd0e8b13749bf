"""The train side's call of diffusers' `FluxTransformer2DModel`, as `FluxPipeline.__call__` makes it. No diffusers
import: the model arrives built (the family names its class; trueflow/train loads it).

The pipeline's call (diffusers 0.42.1): `timestep=timestep / 1000` with `timestep = t.expand(B).to(latents.dtype)`;
`guidance` the fp32 `torch.full([1], guidance_scale).expand(B)` (the engine records it with each branch's
conditioning); `pooled_projections` CLIP's pooled output; `encoder_hidden_states` T5's; `txt_ids` zeros [L, 3] and
`img_ids` (0, row, col) [S, 3], both in the latent dtype; no attention mask; `return_dict=False`.
"""

from __future__ import annotations

import torch
from torch import nn

from .latents import image_ids

# flow_grpo's FLUX.1-dev LoRA targets (yifan123/flow_grpo scripts/train_flux.py): PEFT matches each as a suffix after
# a dot, so the attention ones also adapt the single-stream blocks' q/k/v (`attn.to_q` there too); `to_out.0`,
# `add_*` and the FFNs exist in the double-stream blocks only.
LORA_TARGETS: tuple[str, ...] = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                                 "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj",
                                 "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
SHARD_UNITS: tuple[str, ...] = ("transformer_blocks", "single_transformer_blocks")  # each block one FSDP unit


def model_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' transformer timestep input for schedule timesteps `t` (fp32, 0..1000): `t.to(latent dtype) /
    1000`, two roundings in bf16. (The engine model takes the fp32 `t`; its flux patch group rounds it the same way
    inside, and again as the model's `· 1000` does.)"""
    return t.to(dtype) / 1000


def train_forward(model: nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor, grid: tuple[int, int],
                  cond: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """`timestep` is `model_timestep(t)`; `grid` the (rows, cols) token grid; `cond` holds `encoder_hidden_states`,
    `pooled_projections` and `guidance` (collated)."""
    text = cond["encoder_hidden_states"]
    assert text is not None  # FluxPipeline always passes the T5 embeddings
    dtype, device = hidden_states.dtype, hidden_states.device
    return model(hidden_states=hidden_states, timestep=timestep, guidance=cond["guidance"],
                 pooled_projections=cond["pooled_projections"], encoder_hidden_states=text,
                 # FluxPipeline's `torch.zeros(n, 3).to(device, dtype)`, made on the device (zeros either way):
                 # no host copy, so the step can be captured in a CUDA graph
                 txt_ids=torch.zeros(text.shape[1], 3, device=device, dtype=dtype),
                 img_ids=image_ids(grid, device, dtype), return_dict=False)[0]
