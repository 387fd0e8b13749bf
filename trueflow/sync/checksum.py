"""Checksums of named tensors in one fused pass, identical across devices and runs.

The tensors, in name order, are laid out as one flat byte string, each starting 16-byte aligned (zero padding),
exactly as `sync.buckets.pack` lays them out. Its bytes, read as int32 words w in rows of 4096, are reduced to
one wrapping int64 sum of w · u(row) · v(column), with odd weights from modular multiplications: a flipped bit
changes one term by an odd multiple of a power of two below 2^63, so it always changes the sum, and a tensor moved
to another position meets other weights. Integer sums modulo 2^64 are exact in any order, hence the same on every
device and run. The kernels run per group of consecutive tensors on one device (concatenated, at most 64 MiB at a
time): a few launches per group, not per tensor, and one transfer to the CPU per device. The sum is hashed there
(sha256) after each tensor's name, dtype and shape. `buckets_checksum` gives the same digest read straight off
the buffers of `sync.buckets.pack` (the sender's side of a sync), which already hold that layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch

from .buckets import ALIGN, Bucket, aligned, tensor_bytes, unpack

_COLS = 4096  # words per row
_GROUP_BYTES = 64 << 20  # bytes concatenated at a time: bounds the int64 temporaries (2 x 128 MiB)
_COL_MUL, _COL_MOD = 40503, 65521  # column weights: 2·(c·40503 mod 65521) + 1, distinct and odd for c < 4096
_ROW_MUL, _ROW_MOD = 48271, 2**31 - 1  # row weights: 2·(r·48271 mod (2^31 - 1)) + 1, a period of 2^31 - 1 rows


def _odd_weights(start: int, n: int, mul: int, mod: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64, device=device) * mul % mod * 2 + 1


def _group_sum(parts: list[torch.Tensor], word_offset: int, acc: torch.Tensor) -> None:
    """Add the weighted sum of the byte views `parts` (each of an aligned length), laid out from `word_offset`,
    to `acc`. Zero words fill the row the group starts in and the one it ends in: they add nothing."""
    device = acc.device
    lead = word_offset % _COLS
    nbytes = sum(p.numel() for p in parts)
    tail = -(lead * 4 + nbytes) % (_COLS * 4)
    zeros = torch.zeros(max(lead * 4, tail), dtype=torch.uint8, device=device)
    flat = torch.cat([zeros[:lead * 4], *parts, zeros[:tail]])
    rows = flat.view(torch.int32).view(-1, _COLS)
    cols = _odd_weights(0, _COLS, _COL_MUL, _COL_MOD, device)
    first = word_offset // _COLS
    step = max(1, _GROUP_BYTES // 4 // _COLS)
    for r in range(0, rows.shape[0], step):
        chunk = rows[r:r + step]
        row_sums = (chunk.long() * cols).sum(1)  # < 2^60: exact
        acc += (row_sums * _odd_weights(first + r, chunk.shape[0], _ROW_MUL, _ROW_MOD, device)).sum()  # wraps


@torch.no_grad()
def _digest(manifest: list[tuple[str, torch.dtype, tuple[int, ...]]],
            groups: Iterable[tuple[list[torch.Tensor], int]], extra: str) -> str:
    """sha256 of the manifest, in name order, and the weighted sum of `groups` (byte views, byte offset)."""
    if not manifest:
        return hashlib.sha256(extra.encode()).hexdigest()
    accs: dict[torch.device, torch.Tensor] = {}
    for parts, byte_offset in groups:
        device = parts[0].device
        if device not in accs:
            accs[device] = torch.zeros((), dtype=torch.int64, device=device)
        _group_sum(parts, byte_offset // 4, accs[device])
    total = sum(a.item() for a in accs.values()) % 2**64  # one transfer per device
    h = hashlib.sha256()
    for name, dtype, shape in manifest:
        h.update(f"{name}|{dtype}|{shape}\n".encode())
    h.update(f"sum|{total}\n".encode())
    h.update(extra.encode())
    return h.hexdigest()


def _tensor_groups(tensors: list[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], int]]:
    """The tensors' byte views and padding, cut into groups of consecutive tensors on one device."""
    pads: dict[torch.device, torch.Tensor] = {}  # one zero buffer per device, sliced for every tensor's padding
    group: list[torch.Tensor] = []
    group_offset = offset = 0  # bytes
    for t in tensors:
        if group and (t.device != group[0].device or offset - group_offset >= _GROUP_BYTES):
            yield group, group_offset
            group, group_offset = [], offset
        if t.device not in pads:
            pads[t.device] = torch.zeros(ALIGN, dtype=torch.uint8, device=t.device)
        data = t.detach().reshape(-1).view(torch.uint8)
        pad = aligned(data.numel()) - data.numel()
        group += [data, pads[t.device][:pad]] if pad else [data]
        offset += data.numel() + pad
    if group:
        yield group, group_offset


@torch.no_grad()
def tensors_checksum(tensors: dict[str, torch.Tensor], extra: str = "") -> str:
    """sha256 hex digest of the tensors' names, dtypes, shapes and bits (see the module's docstring), then `extra`."""
    names = sorted(tensors)
    manifest = [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names]
    return _digest(manifest, _tensor_groups([tensors[n] for n in names]), extra)


@torch.no_grad()
def buckets_checksum(buckets: list[Bucket], extra: str = "") -> str:
    """`tensors_checksum(unpack(buckets), extra)`, read straight off the bucket buffers when they hold the tensors
    in name order, each at the next aligned offset, as `pack` lays them out (no concatenation of tensors)."""
    manifest = [(n, dtype, tuple(shape)) for b in buckets for n, dtype, shape, _ in b.manifest]
    names = [n for n, _, _ in manifest]
    if names != sorted(set(names)) or not all(packed_in_order(b) for b in buckets):
        return tensors_checksum(unpack(buckets), extra)
    groups, base = [], 0
    for b in buckets:
        n = b.buffer.numel()
        groups += [([b.buffer[s:s + _GROUP_BYTES]], base + s) for s in range(0, n, _GROUP_BYTES)]
        base += n
    return _digest(manifest, groups, extra)


def packed_in_order(bucket: Bucket) -> bool:
    offset = 0
    for _, dtype, shape, off in bucket.manifest:
        if off != offset:
            return False
        offset += aligned(tensor_bytes(shape, dtype))
    return bucket.buffer.numel() == offset and bucket.buffer.dtype == torch.uint8
