"""Decoding packed video latents to uint8 frames, as `LTX2Pipeline` decodes them (`output_type="pil"` / `"np"`).

The VAE is diffusers' `AutoencoderKLLTX2Video`: off the parity-critical path (decoding runs after the trajectory is
recorded, and the trainer never sees pixels). The pipeline's order: unpack the fp32 latents, cast them to the
pipeline's dtype (its text embeddings'), denormalize with the VAE's per-channel mean/std in that dtype, cast to the
VAE's dtype, decode with no timestep (2.3's VAE has no timestep conditioning), then `(x·0.5 + 0.5).clamp(0, 1)`, fp32,
`·255` rounded half to even.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLLTX2Video  # decode only; see the module docstring

from .latents import latent_grid, unpack_latents


class VideoDecoder:
    """The checkpoint's video VAE, decoding packed latents the way the pipeline does."""

    def __init__(self, checkpoint: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.vae = AutoencoderKLLTX2Video.from_pretrained(checkpoint, subfolder="vae", dtype=dtype)
        self.vae = self.vae.to(device).eval()
        self.dtype = dtype  # the pipeline's dtype, which the latents are cast to before denormalizing

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int) -> torch.Tensor:
        """Packed latents `[B, S, C]` -> uint8 video `[B, num_frames, height, width, 3]` (on the CPU)."""
        vae = self.vae
        x = unpack_latents(latents, latent_grid(height, width, num_frames)).to(vae.device, self.dtype)
        if vae.config.timestep_conditioning:
            raise ValueError("a video VAE with timestep conditioning needs the pipeline's decode noise; "
                             "LTX-2.3's has none")
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(x.device, x.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(x.device, x.dtype)
        x = (x * std / vae.config.scaling_factor + mean).to(vae.dtype)
        video = vae.decode(x, None, return_dict=False)[0]  # [B, 3, F, H, W]
        video = (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu()
        return (video * 255).round().to(torch.uint8)
