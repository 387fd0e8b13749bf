"""The sinusoidal timestep projection: diffusers' `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)`,
which Qwen-Image, LTX-2.3, SD3.5, FLUX.1 and Wan2.2 all embed their timestep with."""

from __future__ import annotations

import math

import torch

TIMESTEP_CHANNELS = 256


def timestep_proj(t: torch.Tensor) -> torch.Tensor:
    """[cos, sin] of `t·ω` in fp32 [N, 256] for fp32 timesteps `t` [N], `ω = exp(i·(-ln 10000 / 128))`. Bitwise
    diffusers' `Timesteps` on the same `t`, which computes the exponent as `(-ln 10000 · i) / 128`: dividing by 128 is
    exact, so both orders round alike. (How a family rounds `t` before it is the family's.)"""
    half = TIMESTEP_CHANNELS // 2
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * (-math.log(10000.0) / half))
    args = t.float()[:, None] * freqs[None, :]
    return torch.cat([args.cos(), args.sin()], dim=-1)
