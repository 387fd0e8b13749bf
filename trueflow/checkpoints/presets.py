"""Qwen-Image transformer presets and the seeded weight init shared by every in-memory and on-disk model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate import init_empty_weights
from diffusers import QwenImageTransformer2DModel
from torch import nn

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
}

INIT_STD = 0.02  # Linear/Embedding weights and all biases
NORM_SCALE_STD = 0.1  # norm scales are 1 + this * randn, so a wrong norm weight shows up numerically


def transformer_config(size: str) -> dict[str, Any]:
    """A copy of the preset `size` (one of TRANSFORMER_CONFIGS)."""
    if size not in TRANSFORMER_CONFIGS:
        raise ValueError(f"unknown transformer size {size!r}; known sizes: {', '.join(TRANSFORMER_CONFIGS)}")
    return dict(TRANSFORMER_CONFIGS[size])


@torch.no_grad()
def init_weights_(module: nn.Module, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Overwrite every parameter of `module` with seeded random values, in place.

    Values are drawn in fp32 from a local generator on `device` in registration order and then cast, so the
    same seed and generator device give the same weights (up to rounding) whatever the parameter dtype, and
    the global RNG is left alone. (A CUDA generator draws other numbers than a CPU one; it is there so a 20B
    model can be initialised on the GPU in seconds.) Biases are random rather than zero so that every op
    matters numerically.
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32, device=device)

    for mod_name, mod in module.named_modules():
        is_norm = "norm" in type(mod).__name__.lower()
        for name, p in mod.named_parameters(recurse=False):
            if name == "bias":
                value = randn(p.shape) * INIT_STD
            elif is_norm and name in ("weight", "gamma"):
                value = 1.0 + randn(p.shape) * NORM_SCALE_STD
            elif isinstance(mod, (nn.Linear, nn.Embedding)) and name == "weight":
                value = randn(p.shape) * INIT_STD
            elif isinstance(mod, nn.modules.conv._ConvNd) and name == "weight":
                # Fan-in scaling keeps activations O(1) through the VAE's deep conv stacks; a flat 0.02 would
                # shrink the signal until the decoded image is just the last conv's bias.
                value = randn(p.shape) * p[0].numel() ** -0.5
            else:
                # A new parameter kind must get an explicit rule rather than silently keep its default init.
                raise TypeError(f"no init rule for {mod_name}.{name} ({type(mod).__name__})")
            p.copy_(value)
    return module


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
            mod.register_parameter(name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), p.requires_grad))
    init_weights_(model, seed, device)
    return model.eval()  # the model has no buffers, so nothing else needs casting to `dtype`
