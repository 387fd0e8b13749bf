"""The parity probe's inputs for the Wan family (the pipeline's own pieces are in prompts.py, latents.py,
schedule.py, vae.py)."""

from __future__ import annotations

import torch

from .latents import PATCH, first_frame_mask

PROBE_FRAMES = 9  # pixel frames of a probe video: 3 latent frames, so the frame RoPE axis has three positions


def probe_inputs(config: dict, batch: int, text_len: int, resolution: int, dtype: torch.dtype, seed: int,
                 device: torch.device | str, spatial: int = 8, per_token: bool = False) -> dict:
    """Seeded probe inputs for a transformer `config`: packed latents of a `resolution`-square, 9-frame video (a VAE of
    spatial factor `spatial`), a text stream of `text_len` tokens, and one schedule timestep (fp32, 0..1000) shared
    by the batch, as a denoising step has; `per_token` (TI2V-5B): an image-to-video step, with one timestep per token
    (the first latent frame's at 0, `WanImageToVideoPipeline`'s first-frame mask: two values) and the first frame's
    image latents (fp32) in the conditioning."""
    g = torch.Generator().manual_seed(seed)
    side = resolution // (spatial * PATCH[1])
    grid = ((PROBE_FRAMES - 1) // 4 + 1, side, side)
    tokens = grid[0] * side * side
    hs = torch.randn(batch, tokens, config["in_channels"] * PATCH[0] * PATCH[1] * PATCH[2], generator=g)
    text = torch.randn(batch, text_len, config["text_dim"], generator=g)
    t = (torch.rand(1, generator=g) * 1000).expand(batch).contiguous()
    cond = {"encoder_hidden_states": text.to(device, dtype)}
    if per_token:
        t = (first_frame_mask(tokens, side * side) * t[:1]).expand(batch, -1).contiguous()
        cond["image_latents"] = torch.randn(batch, side * side, hs.shape[-1], generator=g).to(device)
    return {"hidden_states": hs.to(device, dtype), "timestep": t.to(device), "grid": grid, "cond": cond}
