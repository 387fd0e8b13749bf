"""Qwen-Image transformer presets: the sizes `init-checkpoint --size` and `parity --random-size` take, and the
train side's diffusers model built from one with seeded random weights (train side only: the engine never
imports this file)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
# # from `diffusers.models`: `diffusers`' own TYPE_CHECKING imports name its dummy classes first.
from diffusers.models import QwenImageTransformer2DModel
from torch import nn

from ..random_init import init_weights_

_FULL: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "axes_dims_rope": (16, 56, 56),
    "guidance_embeds": False,
}

TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    # Small enough to write to disk and run the whole pipeline on CPU in well under a second.
    "tiny": {
        **_FULL,
        "num_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 32,
        "joint_attention_dim": 48,
        "axes_dims_rope": (8, 12, 12),
    },
    # The real Qwen-Image (20B) transformer.
    "full": dict(_FULL),
    # Real-width GEMMs and attention at one block (~380M params), for CPU numerics tests.
    "one_block": {**_FULL, "num_layers": 1},
    # The real widths at 12 of the 60 blocks (4.2B): a full-parameter run of it fits one H200 (docs/training.md's
    # memory plan; scripts/gpu_fullft.py).
    "h200_fullft": {**_FULL, "num_layers": 12},
}

def transformer_config(size: str) -> dict[str, Any]:
    """A copy of the preset `size` (one of TRANSFORMER_CONFIGS)."""
    if size not in TRANSFORMER_CONFIGS:
        raise ValueError(f"unknown transformer size {size!r}; known sizes: {', '.join(TRANSFORMER_CONFIGS)}")
    return dict(TRANSFORMER_CONFIGS[size])


def build_transformer(
    size_or_config: str | Mapping[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> QwenImageTransformer2DModel:
    """diffusers' QwenImageTransformer2DModel with seeded random weights, built in memory in `dtype` on `device`
    (the weights drawn there too), eval mode."""
    config = transformer_config(size_or_config) if isinstance(size_or_config, str) else dict(size_or_config)
    # Parameters start on the meta device so a large model is allocated once, directly in `dtype`, and is
    # not default-initialised only to be overwritten. Plain tensor attributes (the RoPE tables) stay real.
    with init_empty_weights():
        model = QwenImageTransformer2DModel(**config)
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                      p.requires_grad))
    init_weights_(model, seed, device)
    return model.eval()  # the model has no buffers, so nothing else needs casting to `dtype`
