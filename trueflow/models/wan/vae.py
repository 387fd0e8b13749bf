"""Decoding packed latents to uint8 frames, as `WanPipeline.__call__` decodes them (`output_type="np"`, then
`numpy_to_pil`'s `(x·255).round()`).

The VAE is diffusers' `AutoencoderKLWan` (Wan2.1's z16 for the A14B, Wan2.2's z48 for the TI2V-5B): off the
parity-critical path (decoding runs after the trajectory is recorded; the trainer never sees pixels). The pipeline's
order: the fp32 latents cast to the VAE's dtype, `latents / (1/std) + mean` with the config's per-channel statistics in
that dtype, decode, then `(x·0.5 + 0.5).clamp(0, 1)`, fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan  # decode only; see the module docstring

from .latents import unpack_latents


class VideoDecoder:
    """The checkpoint's VAE, decoding packed latents the way the pipeline does."""

    def __init__(self, checkpoint: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=dtype).to(device).eval()
        self.spatial = self.vae.config.scale_factor_spatial
        self.temporal = self.vae.config.scale_factor_temporal

    def grid(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        return (num_frames - 1) // self.temporal + 1, height // (2 * self.spatial), width // (2 * self.spatial)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int) -> torch.Tensor:
        """Packed latents `[B, S, C·4]` -> uint8 video `[B, num_frames, height, width, 3]` (on the CPU)."""
        vae = self.vae
        x = unpack_latents(latents, self.grid(height, width, num_frames)).to(vae.device, vae.dtype)
        c = vae.config
        mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(x.device, x.dtype)
        video = vae.decode(x / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W]
        video = (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu()
        return (video * 255).round().to(torch.uint8)
