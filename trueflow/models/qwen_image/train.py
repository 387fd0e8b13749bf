"""The train side's call of diffusers' `QwenImageTransformer2DModel`, as `QwenImagePipeline.__call__` makes it.
No diffusers import: the model arrives built (the family names its class; trueflow/train loads it)."""

from __future__ import annotations

import torch
from torch import nn


def train_forward(model: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                  timestep: torch.Tensor, grid: tuple[int, int],
                  encoder_hidden_states_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`timestep` is t/1000 in the latent dtype (`TrainSide.timestep`); `grid` the (rows, cols) token grid."""
    shapes = [(1, grid[0], grid[1])] * hidden_states.shape[0]
    return model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                 encoder_hidden_states_mask=encoder_hidden_states_mask, timestep=timestep,
                 img_shapes=shapes, return_dict=False)[0]
