"""LTX-2.3's latent layout, as `LTX2Pipeline.prepare_latents` makes it: the video VAE compresses 32x32 pixels and 8
frames (plus the causal first frame) into one latent, and the transformer's patch is 1x1x1, so each latent is one
token; the noise is drawn fp32 as `[B, C, frames, rows, cols]` and packed frame-major into `[B, S, C]`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..spec import Grid

PIXELS_PER_TOKEN = 32  # the VAE's spatial compression x the transformer's patch size 1
FRAMES_PER_TOKEN = 8  # the VAE's temporal compression; frame counts are 8k + 1 (the first frame is its own latent)
SIZE_REASON = f"VAE spatial factor {PIXELS_PER_TOKEN} x patch 1"
FRAME_REASON = f"the VAE's causal temporal factor {FRAMES_PER_TOKEN}: {FRAMES_PER_TOKEN}k + 1 frames"
LATENT_DTYPE = torch.float32  # the pipeline keeps the latents in fp32 through the whole loop


def check_size(height: int, width: int, num_frames: int) -> None:
    """One clear error for a size the pipeline would round down silently."""
    if height % PIXELS_PER_TOKEN or width % PIXELS_PER_TOKEN or height < 1 or width < 1:
        raise ValueError(f"height and width must be positive multiples of {PIXELS_PER_TOKEN} ({SIZE_REASON}), "
                         f"got {height}x{width}")
    if num_frames < 1 or num_frames % FRAMES_PER_TOKEN != 1:
        raise ValueError(f"num_frames must be 1, 9, 17, ... ({FRAME_REASON}), got {num_frames}")


def latent_grid(height: int, width: int, num_frames: int) -> tuple[int, int, int]:
    """The token grid (frames, rows, cols) of a video of `num_frames` frames of `height x width` pixels."""
    check_size(height, width, num_frames)
    return (num_frames - 1) // FRAMES_PER_TOKEN + 1, height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN


def noise_shape(config: Mapping[str, Any] | Any, grid: Grid) -> tuple[int, ...]:  # (frames, rows, cols)
    """One sample's initial noise `(C, frames, rows, cols)` (`prepare_latents` draws the batch `[B, C, F, H, W]`)."""
    channels = config["in_channels"] if isinstance(config, Mapping) else config.in_channels
    return (channels, *grid)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """`[B, C, F, H, W]` -> `[B, F·H·W, C]`: `LTX2Pipeline._pack_latents` with patch sizes 1."""
    return latents.flatten(2, 4).transpose(1, 2)


def unpack_latents(latents: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """`[B, S, C]` -> `[B, C, F, H, W]`: `LTX2Pipeline._unpack_latents` with patch sizes 1."""
    return latents.transpose(1, 2).unflatten(2, grid)
