"""Weight buckets: named tensors packed into a few flat buffers for transport, an A/B pair never split.

A bucket is one contiguous uint8 buffer plus a manifest (name, dtype, shape, byte offset) per tensor; the
receiver rebuilds views into the buffer, so a bucket crosses a process boundary as one IPC handle (shared memory
on CPU, CUDA IPC on GPU) whatever the number of tensors in it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 << 20
ALIGN = 16  # each tensor starts 16-byte aligned, so every view is aligned for any dtype's kernels
Allocate = Callable[[int, torch.device], torch.Tensor]  # (bytes, device) -> a uint8 buffer, e.g. in shared memory


@dataclass
class Bucket:
    buffer: torch.Tensor  # uint8 [nbytes]
    manifest: list[tuple[str, torch.dtype, tuple[int, ...], int]]  # (name, dtype, shape, byte offset)


def _group_key(name: str) -> str:
    """Tensors that must travel together: the A and B of one LoRA module share a key."""
    return re.sub(r"\.lora_[AB]\.", ".lora_*.", name)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype` (a manifest entry), padding excluded."""
    return torch.Size(shape).numel() * dtype.itemsize


def pack(tensors: dict[str, torch.Tensor], max_bytes: int = DEFAULT_BUCKET_BYTES,
         allocate: Allocate | None = None) -> list[Bucket]:
    """Pack into buckets of at most `max_bytes` (a group larger than that gets a bucket of its own); each bucket's
    buffer from `allocate` if given (`sync.shm.SharedSegments.allocate`: in shared memory the receiver can open)."""
    groups: dict[str, list[str]] = {}
    for name in sorted(tensors):
        groups.setdefault(_group_key(name), []).append(name)
    plans: list[list[str]] = [[]]
    size = 0
    for names in groups.values():
        nbytes = sum(aligned(tensors[n].numel() * tensors[n].element_size()) for n in names)
        if plans[-1] and size + nbytes > max_bytes:
            plans.append([])
            size = 0
        plans[-1].extend(names)
        size += nbytes
    return [_pack_one(tensors, names, allocate) for names in plans if names]


def _pack_one(tensors: dict[str, torch.Tensor], names: list[str], allocate: Allocate | None) -> Bucket:
    """One concatenation of the tensors' bytes and zero padding: a few batched copy kernels, not one per tensor."""
    device = tensors[names[0]].device
    zeros = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
    parts, manifest, total = [], [], 0
    for n in names:
        t = tensors[n].detach()
        data = t.reshape(-1).view(torch.uint8).to(device)
        pad = aligned(data.numel()) - data.numel()
        parts += [data, zeros[:pad]] if pad else [data]
        manifest.append((n, t.dtype, tuple(t.shape), total))
        total += data.numel() + pad
    return Bucket(torch.cat(parts) if allocate is None else torch.cat(parts, out=allocate(total, device)), manifest)


class BucketPacker:
    """`pack` for a sender that sends tensors of one layout again and again (a LoRA every sync): the buffers are
    kept and refilled by one batched copy (`torch._foreach_copy_`) instead of being allocated and concatenated
    tensor by tensor. A new layout (names, dtypes, shapes, device) packs afresh. The buffers are reused, so the
    sender must have the receiver's answer (which copies out of them) before it packs again."""

    def __init__(self, max_bytes: int = DEFAULT_BUCKET_BYTES, allocate: Allocate | None = None):
        self.max_bytes, self.allocate = max_bytes, allocate
        self.key: list | None = None
        self.buckets: list[Bucket] = []
        self.views: list[torch.Tensor] = []

    def pack(self, tensors: dict[str, torch.Tensor]) -> list[Bucket]:
        names = sorted(tensors)
        key = [(n, tensors[n].dtype, tensors[n].shape, tensors[n].device) for n in names]
        if key != self.key:
            self.buckets = pack(tensors, self.max_bytes, self.allocate)
            views = unpack(self.buckets)
            self.key, self.views = key, [views[n] for n in names]
        else:
            torch._foreach_copy_(self.views, [tensors[n].detach() for n in names])
        return self.buckets


def unpack(buckets: list[Bucket]) -> dict[str, torch.Tensor]:
    """Views into the buckets' buffers (no copy): the receiver copies them into place, then drops the buckets."""
    out = {}
    for b in buckets:
        for name, dtype, shape, off in b.manifest:
            nbytes = tensor_bytes(shape, dtype)
            out[name] = b.buffer[off:off + nbytes].view(dtype).view(shape)
    return out
