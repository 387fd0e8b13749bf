"""The one attention dispatcher every family's engine DiT calls: a registry of SDPA kernels by name.

Modelled on diffusers' `models/attention_dispatch.py` (`_AttentionBackendRegistry.register`, `dispatch_attention_fn`):
a decorator registers a kernel function under a name, and `attention(q, k, v, mask, backend)` looks the name up. Each
kernel hands SDPA what the diffusers backend it stands for hands it (the same permutes, the same contiguous copies,
the same pinned kernel), so the two sides' kernels see the same call. A module that calls `attention` keeps the
name it passes in its `backend` attribute, so a patch can switch a whole model's kernel (`set_kernel`) without
knowing the family: the batch-invariant mode does (kernel `batch_invariant`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import batch_invariant as _batch_invariant


class KernelFn(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Kernel:
    fn: KernelFn  # q [B, S, H, D], k/v [B, L, H, D], mask None or 4-d (see `attention`) -> [B, S, H, D]
    heads_major: bool  # it copies q/k/v to contiguous [B, H, S, D] first (what `joint_buffer` lays out for)
    cuda_only: bool  # PyTorch has the kernel on CUDA only (diffusers' `_check_device` constraint)


KERNELS: dict[str, Kernel] = {}


def register(name: str, heads_major: bool = False, cuda_only: bool = False) -> Callable[[KernelFn], KernelFn]:
    """Register the decorated function as the attention kernel `name` (refused if the name is taken)."""
    def decorator(fn: KernelFn) -> KernelFn:
        if name in KERNELS:
            raise ValueError(f"attention kernel {name!r} is registered already")
        KERNELS[name] = Kernel(fn, heads_major, cuda_only)
        return fn
    return decorator


def kernel(name: str) -> Kernel:
    if name not in KERNELS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(KERNELS)}")
    return KERNELS[name]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              backend: str) -> torch.Tensor:
    """q [B, S, H, D], k/v [B, L, H, D] -> [B, S, H, D], by the registered kernel `backend`.

    mask: None; a bool key mask [B, L] (True = attend), made [B, 1, 1, L] here as diffusers' `native` backend makes
    a 2-d mask; or a mask SDPA takes as it is: bool [B, 1, 1, L] or an additive bias [B, H, 1, L]."""
    chosen = kernel(backend)
    if chosen.cuda_only and not q.is_cuda:  # refused in one line rather than left to SDPA's "no viable backend"
        raise ValueError(f"the {backend} attention backend runs on CUDA only; use the flash backend (train side "
                         f"`_native_flash`) or sdpa (`native`) on this device")
    if mask is not None and mask.dim() == 2:
        mask = mask[:, None, None, :]
    return chosen.fn(q, k, v, mask)


def set_kernel(model: nn.Module, name: str) -> int:
    """Every attention call of `model` on kernel `name`: sets `backend` on each module that holds a registered
    kernel's name there (the dispatcher's convention). Returns how many modules it set; none is refused, since a
    model whose attention bypasses the dispatcher would silently keep its own kernel."""
    kernel(name)
    count = 0
    for m in model.modules():
        if isinstance(getattr(m, "backend", None), str) and m.backend in KERNELS:
            m.backend = name  # type: ignore[assignment]  # torch's stub: Module.__setattr__ takes only Tensor | Module
            count += 1
    if not count:
        raise ValueError(f"{type(model).__name__} has no module whose attention goes through the shared dispatcher "
                         f"(a `backend` attribute naming a kernel), so kernel {name!r} cannot be set on it")
    return count


def joint_buffer(txt: torch.Tensor, img: torch.Tensor, backend: str) -> torch.Tensor:
    """An empty [B, L + S, H, D] tensor for the joint [text, image] sequence of q, k or v (txt [B, L, H, D], img
    [B, S, H, D]), laid out as `backend` hands it to SDPA: heads-major for a `heads_major` kernel (so its
    `.contiguous()` copies nothing), else token-major, as torch.cat would make it."""
    (B, L, H, D), S = txt.shape, img.shape[1]
    if kernel(backend).heads_major:
        return txt.new_empty(B, H, L + S, D).permute(0, 2, 1, 3)
    return txt.new_empty(B, L + S, H, D)


# -- the kernels ---------------------------------------------------------------------------------------------------
def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, pinned: SDPBackend | None,
          heads_major: bool = False) -> torch.Tensor:
    """SDPA on the permuted [B, H, S, D] views (what diffusers' native backends pass), contiguous copies of them
    with `heads_major` (what `_native_cudnn` passes), with `pinned` the only kernel allowed (None: PyTorch's choice)."""
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    if heads_major:
        q, k, v = (t.contiguous() for t in (q, k, v))
    if pinned is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        with sdpa_kernel(pinned):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.permute(0, 2, 1, 3)


@register("sdpa")
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """PyTorch chooses the kernel for the call it is given: diffusers' `native`."""
    return _sdpa(q, k, v, mask, None)


@register("sdpa_heads_major", heads_major=True)
def sdpa_heads_major(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """PyTorch chooses the kernel for contiguous heads-major [B, H, S, D] q/k/v: what a diffusers processor that
    `torch.cat`s the streams' heads-major views itself before calling SDPA hands it (`JointAttnProcessor2_0`, SD3)."""
    return _sdpa(q, k, v, mask, None, heads_major=True)


@register("math")
def math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The reference kernel pinned: diffusers' `_native_math`."""
    return _sdpa(q, k, v, mask, SDPBackend.MATH)


@register("efficient", cuda_only=True)
def efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The memory-efficient kernel pinned (CUDA only): diffusers' `_native_efficient`."""
    return _sdpa(q, k, v, mask, SDPBackend.EFFICIENT_ATTENTION)


@register("flash")
def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The flash kernel pinned: diffusers' `_native_flash`. It takes no mask (diffusers' backend raises; the train
    side then falls back to a masked backend) and no fp32: such calls run on PyTorch's own choice."""
    if mask is not None:
        warnings.warn("attention got a non-trivial text mask while the flash kernel is pinned: the flash kernel takes "
                      "no mask, so this batch runs PyTorch's masked kernel and is not bitwise equal to the train side "
                      "(parity condition 2; usually mixed prompt lengths in one batch)", stacklevel=3)
    fallback = mask is not None or q.dtype == torch.float32
    return _sdpa(q, k, v, mask, None if fallback else SDPBackend.FLASH_ATTENTION)


@register("cudnn", heads_major=True, cuda_only=True)
def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The cuDNN kernel pinned (CUDA only) on contiguous heads-major copies: diffusers' `_native_cudnn`. It takes no
    fp32: such calls run on PyTorch's own choice."""
    pinned = None if q.dtype == torch.float32 else SDPBackend.CUDNN_ATTENTION
    return _sdpa(q, k, v, mask, pinned, heads_major=True)


@register("batch_invariant")
def batch_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each sample against its own valid keys, every query row alone (`kernels.batch_invariant.attention`): the
    train side's `trueflow_batch_invariant` diffusers backend runs the same function. Takes a key mask (bool, or an
    additive 0 / large-negative one), so mixed text lengths need no other kernel."""
    return _batch_invariant.attention(q, k, v, mask)
