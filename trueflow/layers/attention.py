"""Scaled dot-product attention over [B, S, H, D] tensors, with a choice of kernel."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# "sdpa": PyTorch picks the kernel; "flash": the flash kernel pinned (no mask allowed), which is what the train
# side's `_native_flash` backend runs; "math": the reference kernel.
BACKENDS = {"sdpa": None, "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, backend: str) -> torch.Tensor:
    """q, k, v: [B, S, H, D]; mask: bool [B, S] over keys (True = attend) or None. Returns [B, S, H, D].

    The permutes (not a contiguous [B, H, S, D] copy) are what diffusers' native backends pass to SDPA, so the
    kernel sees the same strides."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)}")
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    attn_mask = None if mask is None else mask[:, None, None, :]
    kernel = BACKENDS[backend]
    if kernel == SDPBackend.FLASH_ATTENTION and attn_mask is not None:
        warnings.warn("attention got a non-trivial text mask while the flash kernel is pinned: the flash kernel takes "
                      "no mask, so this batch runs PyTorch's masked kernel and is not bitwise equal to the train side "
                      "(DESIGN 3 condition 2; usually mixed prompt lengths in one batch)", stacklevel=2)
    if kernel is None or (kernel == SDPBackend.FLASH_ATTENTION and (attn_mask is not None or q.dtype == torch.float32)):
        # The flash kernel takes no mask and no fp32; such calls run on PyTorch's own choice, as diffusers' masked
        # fallback does.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    else:
        with sdpa_kernel(kernel):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return out.permute(0, 2, 1, 3)
