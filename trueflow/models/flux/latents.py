"""FLUX.1's latent layout: the VAE's 8x latents (16 channels) packed 2x2 into tokens of 64 channels, as
`FluxPipeline` packs them (`prepare_latents`, `_pack_latents`, `_unpack_latents`)."""

from __future__ import annotations

import torch

from ..spec import Grid

VAE_SCALE_FACTOR = 8  # pixels per latent (the pipeline: 2 ** (len(vae.config.block_out_channels) - 1))
PATCH = 2  # latents are packed 2x2 into tokens, so one token covers 16x16 pixels
PIXELS_PER_TOKEN = VAE_SCALE_FACTOR * PATCH
SIZE_REASON = f"VAE factor {VAE_SCALE_FACTOR} x packing {PATCH}"


def latent_grid(height: int, width: int, num_frames: int = 1) -> tuple[int, int]:
    """The packed token grid (rows, columns) of an image of `height x width` pixels. FLUX.1 makes images: one
    frame."""
    if num_frames != 1:
        raise ValueError(f"FLUX.1 makes images: num_frames must be 1, got {num_frames}")
    return height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN


def noise_shape(config, grid: Grid) -> tuple[int, ...]:  # (rows, cols)
    """One sample's initial noise as `prepare_latents` draws it: [C/4, 2·rows, 2·cols] (the pipeline's
    `(batch, num_channels_latents, height, width)` less the batch), packed into tokens of C channels after."""
    return config.in_channels // 4, PATCH * grid[0], PATCH * grid[1]


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """`[B, C, h, w]` -> `[B, (h/2)·(w/2), 4C]`: `FluxPipeline._pack_latents`."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`[B, S, 4C]` -> `[B, C, h, w]` for an image of `height x width` pixels: `FluxPipeline._unpack_latents`."""
    b, _, channels = latents.shape
    rows, cols = latent_grid(height, width)
    latents = latents.view(b, rows, cols, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, 2 * rows, 2 * cols)


def image_ids(grid: tuple[int, int], device, dtype: torch.dtype) -> torch.Tensor:
    """`FluxPipeline._prepare_latent_image_ids`: (0, row, col) per token [rows·cols, 3], in fp32, then in `dtype`
    (the latents'). The pipeline builds it on the CPU and moves it; here it is built on `device`: the same small
    integers, exact in fp32 and bf16 alike, and no host copy, so a step that calls it can be captured in a CUDA
    graph."""
    rows, cols = grid
    ids = torch.zeros(rows, cols, 3, device=device)
    ids[..., 1] = ids[..., 1] + torch.arange(rows, device=device)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(cols, device=device)[None, :]
    return ids.reshape(rows * cols, 3).to(dtype=dtype)
