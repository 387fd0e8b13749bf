"""Decoding packed latents to uint8 images, as `StableDiffusion3Pipeline` decodes them (`output_type="pil"`/`"np"`).

The VAE is diffusers' `AutoencoderKL` (16 latent channels): off the parity-critical path (decoding runs after the
trajectory is recorded, and the trainer never sees pixels). The pipeline's order: `latents / scaling_factor +
shift_factor` in the latents' dtype, `vae.decode`, then `VaeImageProcessor.postprocess`: `(x·0.5 + 0.5).clamp(0, 1)`
in the VAE's dtype, fp32, `·255` rounded half to even.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL  # decode only; see the module docstring

from .latents import latent_grid, unpack_latents


class VaeDecoder:
    """The checkpoint's VAE, decoding packed latents the way the pipeline does."""

    def __init__(self, checkpoint: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.vae = AutoencoderKL.from_pretrained(checkpoint, subfolder="vae", dtype=dtype).to(device).eval()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """Packed latents `[B, S, 4C]` -> uint8 images `[B, height, width, 3]` (on the CPU)."""
        vae = self.vae
        x = unpack_latents(latents, latent_grid(height, width, num_frames)).to(vae.device)
        x = (x / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(x, return_dict=False)[0]
        image = (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()
        return (image * 255).round().to(torch.uint8)
