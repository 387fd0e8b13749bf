"""Latent layout (2x2 packing) and decoding packed latents to uint8 images, as `QwenImagePipeline` does.

The VAE is diffusers' `AutoencoderKLQwenImage`: the one place engine code uses a diffusers model. It is off
the parity-critical path: decoding runs after the trajectory (latents, log-probs, guided outputs) is recorded,
and the trainer never sees pixels, only rewards computed from them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage  # decode only; see the module docstring

VAE_SCALE_FACTOR = 8  # pixels per latent (the pipeline: 2 ** len(vae.temperal_downsample))
PATCH = 2  # latents are packed 2x2 into tokens, so one token covers 16x16 pixels
PIXELS_PER_TOKEN = VAE_SCALE_FACTOR * PATCH


def latent_grid(height: int, width: int) -> tuple[int, int]:
    """The packed token grid (rows, columns) of an image of `height x width` pixels: the transformer's img_shape."""
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


class VaeDecoder:
    """The checkpoint's VAE, decoding packed latents the way the pipeline's `output_type="pil"` path does."""

    def __init__(self, checkpoint: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.vae = AutoencoderKLQwenImage.from_pretrained(checkpoint, subfolder="vae", dtype=dtype).to(device).eval()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents `[B, S, C]` -> uint8 images `[B, height, width, 3]` (on the CPU)."""
        vae = self.vae
        x = unpack_latents(latents, height, width).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        # The pipeline's order: std rounded to the latent dtype, its reciprocal taken (and rounded) there, then
        # the latents divided by that reciprocal; dividing by the std, or by an fp32 reciprocal, rounds differently.
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        image = vae.decode(x / inv_std + mean, return_dict=False)[0][:, :, 0]
        # VaeImageProcessor.postprocess: denormalize in the VAE dtype, then fp32 ·255 and round half to even.
        image = (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()
        return (image * 255).round().to(torch.uint8)
