"""RMSNorm for the text input norm and the q/k norms."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Serving-engine RMSNorm: normalise and scale in fp32, round to the input dtype once at the end (a Triton
    kernel on CUDA, this PyTorch code elsewhere)."""
    if kernels.use_triton(x):
        return kernels.ops().rms_norm(x, weight, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.impl = rms_norm_fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x, self.weight, self.eps)
