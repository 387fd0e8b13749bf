"""Decoding packed latents to uint8 frames, as `WanPipeline.__call__` decodes them (`output_type="np"`, then
`numpy_to_pil`'s `(x·255).round()`), and encoding image-to-video's first frame as `WanImageToVideoPipeline` does.

The VAE is diffusers' `AutoencoderKLWan` (Wan2.1's z16 for the A14B, Wan2.2's z48 for the TI2V-5B): off the
parity-critical path (decoding runs after the trajectory is recorded; the trainer never sees pixels). The pipeline's
order: the fp32 latents cast to the VAE's dtype, `latents / (1/std) + mean` with the config's per-channel statistics in
that dtype, decode, then `(x·0.5 + 0.5).clamp(0, 1)`, fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan  # decode only; see the module docstring

from .latents import pack_latents, unpack_latents


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


@torch.no_grad()
def image_cond(decoder: VideoDecoder, image: str | Path, height: int, width: int) -> dict[str, torch.Tensor]:
    """Image-to-video's first frame as `WanImageToVideoPipeline` (with `expand_timesteps`, TI2V-5B) conditions on it:
    the image loaded as `diffusers.utils.load_image` loads it (RGB), `video_processor.preprocess` to `height x width`
    in [-1, 1] (fp32), one frame `[1, 3, 1, H, W]` in the VAE's dtype, the mode of its latent distribution
    (`retrieve_latents(..., sample_mode="argmax")`), in fp32 normalised `(z - mean) * (1 / std)` (`prepare_latents`).
    Returns `image_latents`: the first latent frame's tokens `[rows·cols, C·4]` fp32."""
    from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
    from diffusers.utils import load_image
    from diffusers.video_processor import VideoProcessor

    path = Path(image)
    if not path.is_file():
        raise FileNotFoundError(f"image (--image) {image}: no such file; image-to-video needs its first frame")
    vae = decoder.vae
    pixels = VideoProcessor(vae_scale_factor=decoder.spatial).preprocess(load_image(str(path)), height=height,
                                                                         width=width).to(torch.float32)
    latent = retrieve_latents(vae.encode(pixels.unsqueeze(2).to(vae.device, vae.dtype)), sample_mode="argmax")
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(latent.device, torch.float32)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(latent.device, torch.float32)
    return {"image_latents": pack_latents((latent.to(torch.float32) - mean) * inv_std)[0]}
