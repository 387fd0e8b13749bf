"""FLUX.1 transformer presets: the sizes `init-checkpoint --size` and `parity --random-size` take, and the train
side's diffusers model built from one with seeded random weights (train side only: the engine never imports this
file).

The full size is black-forest-labs/FLUX.1-dev's `transformer/config.json`. That repository is not among the stored
sources searchable here, so its values were checked against what is: FluxTransformer2DModel's own defaults
(diffusers 0.42.1, `transformer_flux.py`: 19 double-stream and 38 single-stream blocks, 24 heads x 128,
joint_attention_dim 4096, pooled_projection_dim 768, axes_dims_rope (16, 56, 56), in_channels 64, patch_size 1, the
FLUX.1 architecture), `guidance_embeds: true` (FLUX.1-dev is guidance-distilled), and copies of the FLUX.1-dev
config in public code (a string search finds several, each `_diffusers_version` 0.30.0, with exactly these keys),
and Black Forest Labs' `flux-dev` parameters as hpcaitech/Open-Sora's `configs/diffusion/inference/plugins/t2i2v.py`
repeats them (hidden 3072, 24 heads, depth 19 / 38, context_in_dim 4096, vec_in_dim 768, axes_dim [16, 56, 56],
guidance_embed True).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
# # from `diffusers.models`: `diffusers`' own TYPE_CHECKING imports name its dummy classes first.
from diffusers.models import FluxTransformer2DModel
from torch import nn

from ..random_init import init_weights_

_FULL: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}

TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    # Two blocks of each kind at small widths: the whole pipeline runs on a CPU in well under a second. The text
    # widths are the tiny T5's and CLIP's (checkpoint.py).
    "tiny": {
        **_FULL,
        "num_layers": 2,
        "num_single_layers": 2,
        "num_attention_heads": 2,
        "attention_head_dim": 32,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "axes_dims_rope": (8, 12, 12),
    },
    # The real FLUX.1-dev (12B) transformer.
    "full": dict(_FULL),
    # Real-width GEMMs and attention at one block of each kind (~0.6B params), for CPU numerics tests.
    "one_block": {**_FULL, "num_layers": 1, "num_single_layers": 1},
}


def transformer_config(size: str) -> dict[str, Any]:
    """A copy of the preset `size` (one of TRANSFORMER_CONFIGS)."""
    if size not in TRANSFORMER_CONFIGS:
        raise ValueError(f"unknown transformer size {size!r}; known sizes: {', '.join(TRANSFORMER_CONFIGS)}")
    return dict(TRANSFORMER_CONFIGS[size])


def build_transformer(
    size_or_config: str | Mapping[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> FluxTransformer2DModel:
    """diffusers' FluxTransformer2DModel with seeded random weights, built in memory in `dtype` on `device` (the
    weights drawn there too), eval mode."""
    config = transformer_config(size_or_config) if isinstance(size_or_config, str) else dict(size_or_config)
    config = {k: v for k, v in config.items() if not k.startswith("_")}  # a config.json's _class_name etc.
    # Parameters start on the meta device so a large model is allocated once, directly in `dtype`, and is not
    # default-initialised only to be overwritten (the model has no buffers: FluxPosEmbed builds its tables per call).
    with init_empty_weights():
        model = FluxTransformer2DModel(**config)
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=dtype, device=device)
            mod.register_parameter(name, nn.Parameter(empty, p.requires_grad))
    init_weights_(model, seed, device)
    return model.eval()
