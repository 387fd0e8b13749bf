"""The parity probe's inputs for an SD3 transformer config."""

from __future__ import annotations

import torch

from .latents import PATCH, PIXELS_PER_TOKEN


def probe_inputs(config: dict, batch: int, text_len: int, resolution: int, dtype: torch.dtype, seed: int,
                 device: torch.device | str) -> dict:
    """Seeded probe inputs: packed latents of a `resolution`-square image, `text_len` joint text tokens and the pooled
    projection, and one schedule timestep (fp32, 0..1000) shared by the batch, as a denoising step has. Both sides take
    the timestep as is (the pipeline passes the fp32 schedule timestep)."""
    g = torch.Generator().manual_seed(seed)
    side = resolution // PIXELS_PER_TOKEN
    hs = torch.randn(batch, side * side, config["in_channels"] * PATCH * PATCH, generator=g)
    ehs = torch.randn(batch, text_len, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(batch, config["pooled_projection_dim"], generator=g)
    t = (torch.rand(1, generator=g) * 1000).expand(batch).contiguous()
    return {"hidden_states": hs.to(device, dtype), "timestep": t.to(device), "grid": (side, side),
            "cond": {"encoder_hidden_states": ehs.to(device, dtype), "pooled_projections": pooled.to(device, dtype)}}
