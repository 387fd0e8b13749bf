"""The tensor-parallel process group and its two collectives: a sum across ranks in fixed rank order, and an
all-gather that concatenates the ranks' shards (bits moved, no arithmetic).

An all_reduce sums in whatever order its algorithm picks (ring, tree, chunked), which a train side cannot
reproduce. Here every rank gathers all partial outputs and adds them itself, rank 0 first: `((p0 + p1) + p2) + ...`
in the tensors' dtype, the same on every rank and the same as the TP-matched train side's sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..net import LOOPBACK, keep_sockets_on, tcp_store


@dataclass
class TPGroup:
    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: the default group
    collectives: int = field(default=0)  # collectives issued so far (a test counts them per forward)


def init_tp(rank: int, size: int, port: int, device: torch.device) -> TPGroup:
    """Join the default process group on loopback (its store, gloo's and NCCL's sockets: `net`): gloo on the CPU,
    NCCL on CUDA."""
    keep_sockets_on(LOOPBACK)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=tcp_store(LOOPBACK, port, rank, size), rank=rank, world_size=size,
                            **kwargs)
    return TPGroup(rank, size)


def gather_sum(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Σ_r x_r over the ranks, added in rank order (p0 + p1, then + p2, ...) in x's dtype, identical on every rank."""
    tp.collectives += 1
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return rank_order_sum(parts)


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The one summation order both sides use: rank 0's part first, then each next rank's, one rounding per add."""
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def gather_cat(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """Every rank's x concatenated along `dim` in rank order (the same tensor on every rank)."""
    tp.collectives += 1
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=dim)
