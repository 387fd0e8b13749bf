"""Checksums of named tensors, cheap on any device and identical across devices and runs.

Each tensor's raw bits, viewed as int16 words (whatever its float dtype), are reduced on its own device to two
int64s: the plain sum and the sum weighted by `(position mod 65521) + 1`, which also catches moved values. A
term is below 2^31, so no sum can overflow for tensors under 4e9 words: integer sums are exact in any order,
hence the same on every device and run. The sums reach the CPU in one transfer and are hashed there (sha256)
with each tensor's name, dtype and shape, in name order.
"""

from __future__ import annotations

import hashlib

import torch


def _bit_sums(t: torch.Tensor) -> torch.Tensor:
    words = t.detach().contiguous().reshape(-1).view(torch.int16).long()
    weight = torch.arange(words.numel(), device=words.device) % 65521 + 1
    return torch.stack([words.sum(), (words * weight).sum()])


@torch.no_grad()
def tensors_checksum(tensors: dict[str, torch.Tensor], extra: str = "") -> str:
    names = sorted(tensors)
    if not names:
        return hashlib.sha256(extra.encode()).hexdigest()
    device = tensors[names[0]].device
    sums = torch.stack([_bit_sums(tensors[n]).to(device) for n in names]).cpu().tolist()  # one transfer
    h = hashlib.sha256()
    for n, (plain, weighted) in zip(names, sums):
        t = tensors[n]
        h.update(f"{n}|{t.dtype}|{tuple(t.shape)}|{plain}|{weighted}\n".encode())
    h.update(extra.encode())
    return h.hexdigest()
