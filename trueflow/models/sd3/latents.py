"""SD3's latent layout: `StableDiffusion3Pipeline.prepare_latents` draws `[B, 16, H/8, W/8]` noise in the pipeline's
dtype (the prompt embeddings'; bf16), which the transformer patches 2x2. The engine records the latents as packed
tokens `[B, (h/2)·(w/2), 4C]`, each token one patch in the conv weight's channel order (c, p, q), so the engine's
patch embedding is a GEMM on a token; the train side unpacks them to the pipeline's `[B, C, h, w]` (a permutation:
no value changes) before calling diffusers' transformer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..spec import Grid

VAE_SCALE_FACTOR = 8  # pixels per latent: 2 ** (len(vae.config.block_out_channels) - 1)
PATCH = 2  # the transformer's patch_size
PIXELS_PER_TOKEN = VAE_SCALE_FACTOR * PATCH
SIZE_REASON = f"VAE factor {VAE_SCALE_FACTOR} x patch {PATCH}, as StableDiffusion3Pipeline.check_inputs requires"


def latent_grid(height: int, width: int, num_frames: int = 1) -> tuple[int, int]:
    """The patch grid (rows, cols) of an image of `height x width` pixels. SD3 makes images: one frame."""
    if num_frames != 1:
        raise ValueError(f"SD3 makes images: num_frames must be 1, got {num_frames}")
    if height % PIXELS_PER_TOKEN or width % PIXELS_PER_TOKEN or height < 1 or width < 1:
        raise ValueError(f"height and width must be positive multiples of {PIXELS_PER_TOKEN} ({SIZE_REASON}), "
                         f"got {height}x{width}")
    return height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN


def noise_shape(config: Mapping[str, Any] | Any, grid: Grid) -> tuple[int, ...]:  # (rows, cols)
    """One sample's initial noise `(C, h, w)` (`prepare_latents` draws the batch `[B, C, h, w]`; with a list of
    generators, each sample `[1, C, h, w]` from its own)."""
    channels = config["in_channels"] if isinstance(config, Mapping) else config.in_channels
    return channels, PATCH * grid[0], PATCH * grid[1]


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """`[B, C, h, w]` -> `[B, (h/2)·(w/2), 4C]`, channels (c, p, q) of each 2x2 patch."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack_latents(tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """`[B, rows·cols, 4C]` -> `[B, C, 2·rows, 2·cols]`, the inverse of `pack_latents` (a view where it can be)."""
    b, _, channels = tokens.shape
    rows, cols = grid
    x = tokens.view(b, rows, cols, channels // (PATCH * PATCH), PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // (PATCH * PATCH), PATCH * rows, PATCH * cols)
