"""Scaled dot-product attention over [B, S, H, D] tensors, with a choice of kernel."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# "sdpa": PyTorch picks the kernel; "flash": the flash kernel pinned (no mask allowed), which is what the train
# side's `_native_flash` backend runs; "cudnn": the cuDNN kernel pinned (CUDA only), what `_native_cudnn` runs;
# "math": the reference kernel.
BACKENDS = {"sdpa": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH}
# Kernels handed contiguous [B, H, S, D] tensors, as diffusers' `_native_cudnn` hands them (`.contiguous()` after the
# permute); the others get the permuted [B, S, H, D] views, as `_native_flash` passes them.
HEADS_MAJOR = frozenset({"cudnn"})


def joint_buffer(txt: torch.Tensor, img: torch.Tensor, backend: str) -> torch.Tensor:
    """An empty [B, L + S, H, D] tensor for the joint [text, image] sequence of q, k or v (txt [B, L, H, D], img
    [B, S, H, D]), laid out as `attention` hands it to the kernel: heads-major for `HEADS_MAJOR` backends (so their
    `.contiguous()` copies nothing), else token-major, as torch.cat would make it."""
    (B, L, H, D), S = txt.shape, img.shape[1]
    if backend in HEADS_MAJOR:
        return txt.new_empty(B, H, L + S, D).permute(0, 2, 1, 3)
    return txt.new_empty(B, L + S, H, D)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, backend: str) -> torch.Tensor:
    """q, k, v: [B, S, H, D]; mask: bool [B, S] over keys (True = attend) or None. Returns [B, S, H, D].

    The permutes (not a contiguous [B, H, S, D] copy) are what diffusers' native flash backend passes to SDPA, and
    the contiguous copies what its cuDNN backend passes, so the kernel sees the same strides."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)}")
    kernel = BACKENDS[backend]
    if kernel == SDPBackend.CUDNN_ATTENTION and not q.is_cuda:
        raise ValueError("the cudnn attention backend runs on CUDA only; use the flash backend (train side "
                         "`_native_flash`) on this device")
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    if backend in HEADS_MAJOR:
        q, k, v = (t.contiguous() for t in (q, k, v))
    attn_mask = None if mask is None else mask[:, None, None, :]
    if kernel == SDPBackend.FLASH_ATTENTION and attn_mask is not None:
        warnings.warn("attention got a non-trivial text mask while the flash kernel is pinned: the flash kernel takes "
                      "no mask, so this batch runs PyTorch's masked kernel and is not bitwise equal to the train side "
                      "(parity condition 2; usually mixed prompt lengths in one batch)", stacklevel=2)
    fp32 = q.dtype == torch.float32
    if kernel is None or (kernel == SDPBackend.FLASH_ATTENTION and (attn_mask is not None or fp32)) or \
            (kernel == SDPBackend.CUDNN_ATTENTION and fp32):
        # The flash kernel takes no mask, and neither it nor cuDNN's takes fp32; such calls run on PyTorch's own
        # choice, as diffusers' masked fallback does.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    else:
        with sdpa_kernel(kernel):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return out.permute(0, 2, 1, 3)
