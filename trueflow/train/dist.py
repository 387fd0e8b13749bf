"""The process group of a training run: torchrun's, or a one-rank group on loopback for the embedded default
(so one code path — FSDP2 — serves one process and many). Its store and sockets bind the rendezvous address only:
loopback unless a multi-node run names another (`net.tcp_store`, docs/scaling.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..net import LOOPBACK, keep_sockets_on, tcp_store


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> DistContext:
    """gloo on CPU, NCCL on CUDA. Under torchrun (or a Ray run's driver) the env names rank, world and the
    rendezvous (MASTER_ADDR, default 127.0.0.1); otherwise a one-rank group on 127.0.0.1. A CUDA rank takes the GPU
    of its local rank."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        host = os.environ.setdefault("MASTER_ADDR", LOOPBACK) if "RANK" in os.environ else LOOPBACK
        keep_sockets_on(host)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store
            dist.init_process_group(backend)
        elif "RANK" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = tcp_store(host, int(os.environ["MASTER_PORT"]), rank, world)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, store=tcp_store(LOOPBACK, 0, 0, 1), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return DistContext(rank, world, torch.device("cuda", local))
    return DistContext(rank, world, torch.device(device))


def all_reduce(values: dict[str, float], op: dist.ReduceOp.RedOpType) -> dict[str, float]:  # dist.ReduceOp.SUM's type
    """`op` (MAX for the parity metrics, SUM for totals) over ranks of each value."""
    if not values or dist.get_world_size() == 1:
        return dict(values)
    t = torch.tensor(list(values.values()), dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op)
    return dict(zip(values, t.tolist()))


def all_gather_object(obj) -> list:
    """Every rank's `obj` (picklable, on the CPU), in rank order."""
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
