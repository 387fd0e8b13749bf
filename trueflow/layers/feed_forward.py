"""The MLP of a DiT block: diffusers' `FeedForward(activation_fn="gelu-approximate")`, proj_in, GELU with the tanh
approximation, proj_out (Qwen-Image, LTX-2.3; SD3.5, FLUX.1 and Wan2.2 use the same). With `out_dim` it is also
diffusers' `PixArtAlphaTextProjection(act_fn="gelu_tanh")` (`linear_1`, GELU-tanh, `linear_2`), the caption
projection of Wan2.2 (`text_dim` -> width -> width)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear


class FeedForward(nn.Module):
    def __init__(self, dim: int, inner_dim: int, bias: bool = True, out_dim: int | None = None):
        super().__init__()
        self.proj_in = Linear(dim, inner_dim, bias=bias)
        self.proj_out = Linear(inner_dim, dim if out_dim is None else out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))
