"""Seeded random weights for any model the project builds in memory or writes to disk (every family's presets
and tiny checkpoints use it), so the same seed gives the same weights whatever the dtype."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)

INIT_STD = 0.02  # Linear/Embedding weights and all biases
NORM_SCALE_STD = 0.1  # norm scales are 1 + this * randn, so a wrong norm weight shows up numerically


@torch.no_grad()
def init_weights_(module: M, seed: int, device: str | torch.device = "cpu") -> M:
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
