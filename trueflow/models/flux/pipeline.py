"""The parity probe's seeded inputs for a FLUX.1 transformer config."""

from __future__ import annotations

import torch

from .latents import PIXELS_PER_TOKEN


def probe_inputs(config: dict, batch: int, text_len: int, resolution: int, dtype: torch.dtype, seed: int,
                 device: torch.device | str) -> dict:
    """Packed latents of a `resolution`-square image, T5 embeddings of `text_len` tokens, CLIP's pooled vector, one
    schedule timestep (fp32, 0..1000) shared by the batch as a denoising step has, and a distilled guidance scale
    per sample (fp32; drawn in 1..5 so that each sample's differs)."""
    g = torch.Generator().manual_seed(seed)
    side = resolution // PIXELS_PER_TOKEN
    hs = torch.randn(batch, side * side, config["in_channels"], generator=g)
    text = torch.randn(batch, text_len, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(batch, config["pooled_projection_dim"], generator=g)
    t = (torch.rand(1, generator=g) * 1000).expand(batch).contiguous()
    guidance = 1 + 4 * torch.rand(batch, generator=g)
    return {"hidden_states": hs.to(device, dtype), "timestep": t.to(device), "grid": (side, side),
            "cond": {"encoder_hidden_states": text.to(device, dtype), "pooled_projections": pooled.to(device, dtype),
                     "guidance": guidance.to(device)}}
