"""SD3 transformer presets: the sizes `init-checkpoint --size` and `parity --random-size` take, and the train side's
diffusers model built from one with seeded random weights (train side only: the engine never imports this file).

`full` is the SD3.5-Medium transformer (MMDiT-X), as its `transformer/config.json` reads (stabilityai/
stable-diffusion-3.5-medium at b940f67, seen through a fine-tune's copy of it on the Hub and two codebases'
transcriptions, all agreeing; the original repository is gated and not in the stored index): 24 layers of 24 heads x
64 (width 1536 = caption_projection_dim), dual attention in layers 0-12, per-head q/k RMSNorm, positions cropped from
a 384 x 384 table, joint_attention_dim 4096 (T5-XXL), pooled_projection_dim 2048 (CLIP-L 768 + CLIP-G 1280).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
# # from `diffusers.models`: `diffusers`' own TYPE_CHECKING imports name its dummy classes first.
from diffusers.models import SD3Transformer2DModel
from torch import nn

from ..random_init import init_weights_

_FULL: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}

TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    # Every kind of block at small widths: a dual-attention block (MMDiT-X), a plain joint block and the context
    # pre-only last block; 64 wide (2 heads x 32) so the fast paths' roundings differ from diffusers' (a narrower
    # GEMM can reduce in the same order by accident). Positions for images up to 256 px.
    "tiny": {
        **_FULL,
        "sample_size": 32,
        "num_layers": 3,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": 48,  # T5's width: wider than CLIP L + G (16 + 16), so the pipeline pads them
        "caption_projection_dim": 64,
        "pooled_projection_dim": 32,
        "pos_embed_max_size": 16,
        "dual_attention_layers": (0,),
    },
    # The real SD3.5-Medium transformer (2.5B).
    "full": dict(_FULL),
    # Its real widths in two blocks: a dual-attention joint block and the context pre-only last block (the
    # batch-invariant tests' GEMM widths). Positions for images up to 256 px: the full 384² table alone is 0.9 GB.
    "one_block": {**_FULL, "num_layers": 2, "dual_attention_layers": (0,), "pos_embed_max_size": 16},
}


def transformer_config(size: str) -> dict[str, Any]:
    """A copy of the preset `size` (one of TRANSFORMER_CONFIGS)."""
    if size not in TRANSFORMER_CONFIGS:
        raise ValueError(f"unknown transformer size {size!r}; known sizes: {', '.join(TRANSFORMER_CONFIGS)}")
    return dict(TRANSFORMER_CONFIGS[size])


def build_transformer(
    size_or_config: str | Mapping[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> SD3Transformer2DModel:
    """diffusers' SD3Transformer2DModel with seeded random weights, built in memory in `dtype` on `device` (the
    weights drawn there too), eval mode. The sin-cos position table (a buffer diffusers computes) is cast to `dtype`
    as `from_pretrained(dtype=...)` casts it, so a model built here equals one loaded from its saved folder."""
    config = transformer_config(size_or_config) if isinstance(size_or_config, str) else dict(size_or_config)
    config = {k: v for k, v in config.items() if not k.startswith("_")}  # a config.json's _class_name etc.
    # Parameters start on the meta device so a large model is allocated once, directly in `dtype`; the position
    # table buffer is computed for real.
    with init_empty_weights():
        model = SD3Transformer2DModel(**config)
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=dtype, device=device)
            mod.register_parameter(name, nn.Parameter(empty, p.requires_grad))
    init_weights_(model, seed, device)
    for mod in model.modules():  # the position table (a buffer) as from_pretrained(dtype=...) loads it
        for name in list(mod._buffers):
            mod._buffers[name] = mod._buffers[name].to(device=device, dtype=dtype)
    return model.eval()
