"""Decoding packed latents to uint8 images, as `FluxPipeline` does.

The VAE is diffusers' `AutoencoderKL`: one of the two places engine code uses diffusers (the schedule is the other).
It is off the parity-critical path: decoding runs after the trajectory is recorded, and the trainer never sees
pixels, only rewards computed from them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL  # decode only; see the module docstring

from .latents import unpack_latents


class VaeDecoder:
    """The checkpoint's VAE, decoding packed latents the way the pipeline's `output_type="pil"` path does."""

    def __init__(self, checkpoint: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.vae = AutoencoderKL.from_pretrained(checkpoint, subfolder="vae", dtype=dtype).to(device).eval()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """Packed latents `[B, S, C]` -> uint8 images `[B, height, width, 3]` (on the CPU)."""
        vae = self.vae
        # FluxPipeline: unpack, `latents / scaling_factor + shift_factor` in the latents' dtype, decode.
        x = unpack_latents(latents, height, width)
        x = (x / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(x.to(vae.device, vae.dtype), return_dict=False)[0]
        # VaeImageProcessor.postprocess: denormalize in the VAE dtype, then fp32 ·255 and round half to even.
        image = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu()
        return (image * 255).round().to(torch.uint8)
