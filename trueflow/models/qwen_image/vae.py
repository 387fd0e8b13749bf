"""Decoding packed latents to uint8 images, as `QwenImagePipeline` does.

The VAE is diffusers' `AutoencoderKLQwenImage`: one of the two places engine code uses diffusers (the schedule is the
other). It is off the parity-critical path: decoding runs after the trajectory (latents, log-probs, guided
outputs) is recorded, and the trainer never sees pixels, only rewards computed from them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage  # decode only; see the module docstring

from .latents import unpack_latents


class VaeDecoder:
    """The checkpoint's VAE, decoding packed latents the way the pipeline's `output_type="pil"` path does."""

    def __init__(self, checkpoint: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.vae = AutoencoderKLQwenImage.from_pretrained(checkpoint, subfolder="vae", dtype=dtype).to(device).eval()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """Packed latents `[B, S, C]` of one frame -> uint8 images `[B, height, width, 3]` (on the CPU)."""
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
