"""Qwen-Image's latent layout: the VAE's 8x latents packed 2x2 into tokens, as `QwenImagePipeline` packs them."""

from __future__ import annotations

import torch

VAE_SCALE_FACTOR = 8  # pixels per latent (the pipeline: 2 ** len(vae.temperal_downsample))
PATCH = 2  # latents are packed 2x2 into tokens, so one token covers 16x16 pixels
PIXELS_PER_TOKEN = VAE_SCALE_FACTOR * PATCH


def latent_grid(height: int, width: int, num_frames: int = 1) -> tuple[int, int]:
    """The packed token grid (rows, columns) of an image of `height x width` pixels: the transformer's
    `img_shapes` entry (without its frame axis). Qwen-Image makes images: one frame."""
    if num_frames != 1:
        raise ValueError(f"Qwen-Image makes images: num_frames must be 1, got {num_frames}")
    return height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """`[B, 1, C, h, w]` -> `[B, (h/2)·(w/2), 4C]`: `QwenImagePipeline._pack_latents`."""
    b, _, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`[B, S, 4C]` -> `[B, C, 1, h, w]` for an image of `height x width` pixels: `_unpack_latents`."""
    b, _, channels = latents.shape
    rows, cols = latent_grid(height, width)
    latents = latents.view(b, rows, cols, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, 1, 2 * rows, 2 * cols)
