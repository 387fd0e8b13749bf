"""The train side's call of diffusers' `QwenImageTransformer2DModel`, as `QwenImagePipeline.__call__` makes it.
No diffusers import: the model arrives built (the family names its class; trueflow/train loads it)."""

from __future__ import annotations

import torch
from torch import nn


def model_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' transformer timestep input for schedule timesteps `t` (fp32, 0..1000), as `QwenImagePipeline`
    computes it: `t.to(latent dtype) / 1000`. In bf16 that rounds twice (t, then the quotient), which differs
    from rounding the fp32 `t / 1000` once in about a quarter of the timesteps of a 10-step schedule. (The
    engine model takes the fp32 `t` itself; its qwen_image patch group rounds it the same way inside.)"""
    return t.to(dtype) / 1000


def train_forward(model: nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor, grid: tuple[int, int],
                  cond: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """`timestep` is `model_timestep(t)`; `grid` the (rows, cols) token grid; `cond` holds `encoder_hidden_states`
    and `encoder_hidden_states_mask` (None: all tokens valid)."""
    shapes = [(1, grid[0], grid[1])] * hidden_states.shape[0]
    return model(hidden_states=hidden_states, encoder_hidden_states=cond["encoder_hidden_states"],
                 encoder_hidden_states_mask=cond.get("encoder_hidden_states_mask"), timestep=timestep,
                 img_shapes=shapes, return_dict=False)[0]
