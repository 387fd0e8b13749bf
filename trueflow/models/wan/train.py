"""The train side's call of diffusers' `WanTransformer3DModel`, as `WanPipeline.__call__` makes it (each branch of
its CFG). No diffusers import: the model arrives built.

The pipeline's call (diffusers 0.42.1): `hidden_states` the fp32 latents `[B, C, F, H, W]` cast to the transformer's
dtype; `timestep` the scheduler's fp32 `t.expand(B)`, or with `expand_timesteps` (TI2V-5B) one per token `[B, S]`;
`encoder_hidden_states` the prompt's embeddings zero-padded to `max_sequence_length`, no text mask; the output
`[B, C, F, H, W]`. The record holds packed tokens (`latents.py`), unpacked here to the contiguous latent video the
pipeline passes, and the output packed back (both permutations: no value changes).
"""

from __future__ import annotations

import torch
from torch import nn

from .latents import first_frame_inputs, pack_latents, unpack_latents

# LoRA on each block's self-attention (attn1) and text cross-attention (attn2) q/k/v/out and its FFN: PEFT matches an
# entry as a suffix after a dot, so these hit `blocks.N.<entry>` and nothing of the embedders.
LORA_TARGETS: tuple[str, ...] = tuple(
    f"{attn}.{proj}" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v", "to_out.0")
) + ("ffn.net.0.proj", "ffn.net.2")

SHARD_UNITS: tuple[str, ...] = ("blocks",)  # each block one FSDP unit, the rest one more


def train_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the pipeline passes as `timestep` for schedule timestep t (`[B]` or per token `[B, S]`): the Euler
    scheduler's fp32 timesteps as they are, whatever the model `dtype`."""
    return t.to(torch.float32)


def train_forward(model: nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor, grid: tuple[int, int, int],
                  cond: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """The prediction `[B, S, C·4]` for packed latents `hidden_states` (in the model dtype), `timestep` =
    `train_timestep(t)`, `grid` = (latent frames, rows, cols) in patches, and `cond` from `encode_prompts`
    (collated); with `image_latents` in `cond` (image-to-video, TI2V-5B), the model input and the per-token
    timestep as `WanImageToVideoPipeline.__call__` makes them with `expand_timesteps` (`latents.first_frame_inputs`)."""
    if (image_latents := cond.get("image_latents")) is not None:
        hidden_states, timestep = first_frame_inputs(hidden_states, timestep, image_latents)
    out = model(hidden_states=unpack_latents(hidden_states, grid), timestep=timestep,
                encoder_hidden_states=cond["encoder_hidden_states"], return_dict=False)[0]
    return pack_latents(out)
