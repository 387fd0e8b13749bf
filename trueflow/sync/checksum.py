"""Checksums of named tensors in one fused pass, identical across devices and runs.

The tensors, in name order, are laid out as one flat byte string, each starting 16-byte aligned (zero padding),
exactly as `sync.buckets.pack` lays them out. Its bytes, read as int32 words w in rows of 4096, are reduced to
one wrapping int64 sum of w · u(row) · v(column), with odd weights from modular multiplications: a flipped bit
changes one term by an odd multiple of a power of two below 2^63, so it always changes the sum, and a tensor moved
to another position meets other weights. Integer sums modulo 2^64 are exact in any order, hence the same on every
device and run. The kernels run per group of consecutive tensors on one device (concatenated, at most 64 MiB at a
time): a few launches per group, not per tensor, and one transfer to the CPU per device. The sum is hashed there
(sha256) after each tensor's name, dtype and shape.
"""

from __future__ import annotations

import hashlib

import torch

from .buckets import ALIGN, aligned

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
def tensors_checksum(tensors: dict[str, torch.Tensor], extra: str = "") -> str:
    """sha256 hex digest of the tensors' names, dtypes, shapes and bits (see the module's docstring), then `extra`."""
    names = sorted(tensors)
    if not names:
        return hashlib.sha256(extra.encode()).hexdigest()
    accs: dict[torch.device, torch.Tensor] = {}
    pads: dict[torch.device, torch.Tensor] = {}  # one zero buffer per device, sliced for every tensor's padding
    group: list[torch.Tensor] = []
    group_offset = offset = 0  # bytes
    group_device = None
    for n in names:
        t = tensors[n].detach()
        if group and (t.device != group_device or offset - group_offset >= _GROUP_BYTES):
            _group_sum(group, group_offset // 4, accs[group_device])
            group, group_offset = [], offset
        group_device = t.device
        if group_device not in accs:
            accs[group_device] = torch.zeros((), dtype=torch.int64, device=group_device)
            pads[group_device] = torch.zeros(ALIGN, dtype=torch.uint8, device=group_device)
        data = t.reshape(-1).view(torch.uint8)
        pad = aligned(data.numel()) - data.numel()
        group += [data, pads[group_device][:pad]] if pad else [data]
        offset += data.numel() + pad
    _group_sum(group, group_offset // 4, accs[group_device])
    total = sum(a.item() for a in accs.values()) % 2**64  # one transfer per device
    h = hashlib.sha256()
    for n in names:
        h.update(f"{n}|{tensors[n].dtype}|{tuple(tensors[n].shape)}\n".encode())
    h.update(f"sum|{total}\n".encode())
    h.update(extra.encode())
    return h.hexdigest()
