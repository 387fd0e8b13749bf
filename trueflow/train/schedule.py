"""The learning-rate schedule and the EMA of the trained weights: both advance once per optimizer step and are saved in
checkpoints, so a resumed run continues them exactly."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, total: int, warmup: int, kind: str) -> float:
    """The factor on the base lr for 0-based optimizer step `step` of `total`: linear warmup `step/warmup` over
    the first `warmup` steps, then constant 1, linear decay `1 − p` or cosine `(1 + cos πp)/2` (SGDR, Loshchilov &
    Hutter, arXiv 1608.03983, Eq. 5 with η_min = 0 and one cycle, T_cur/T_i = p), `p = (step − warmup) / (total −
    warmup)` the fraction of the post-warmup steps done (the convention of transformers'
    `get_cosine_schedule_with_warmup`)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr schedule must be one of {SCHEDULES}, got {kind!r}")
    if step < warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    p = (step - warmup) / max(1, total - warmup)
    return max(0.0, 1.0 - p) if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))


def lr_scheduler(optimizer: torch.optim.Optimizer, total: int, warmup: int, kind: str) -> LambdaLR:
    """torch's LambdaLR over `lr_multiplier` (its state dict is plain values: a checkpoint restores it)."""
    return LambdaLR(optimizer, functools.partial(lr_multiplier, total=total, warmup=warmup, kind=kind))


class WeightsEMA:
    """An exponential moving average of the trained masters (a LoRA's, or every weight of a full fine-tune), `e ←
    d·e + (1 − d)·θ` after every optimizer step, starting from the initial weights (Polyak-Juditsky averaging in its
    exponential form, as in Karras et al., EDM2, arXiv 2312.02696, Sec. 3.1). Kept in fp32 and sharded like the
    masters (FSDP2 DTensors); `offload`: each rank keeps its shards in CPU memory instead (a full fine-tune's EMA
    is as large as its masters), and each update moves the masters' shards there."""

    def __init__(self, params: dict[str, nn.Parameter], decay: float, offload: bool = False):
        self.decay, self.offload = decay, offload
        self.layout = {name: _layout(p) for name, p in params.items()}  # how to rebuild a DTensor from its shard
        self.shadow = {name: _offloaded(p) if offload else p.detach().clone() for name, p in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, nn.Parameter]) -> None:
        for name, p in params.items():
            self.shadow[name].mul_(self.decay).add_(_offloaded(p) if self.offload else p.detach(),
                                                    alpha=1.0 - self.decay)

    def sharded(self, name: str) -> torch.Tensor:
        """The EMA of `name` as its master is held (a DTensor under FSDP2): an offloaded shard is moved back first."""
        e = self.shadow[name]
        layout = self.layout[name]
        if not self.offload or layout is None:
            return e
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = layout
        return DTensor.from_local(e.to(mesh.device_type), mesh, placements, shape=shape, stride=stride,
                                  run_check=False)

    @torch.no_grad()
    def load_(self, name: str, value: torch.Tensor) -> None:
        """Set the EMA of `name` from a tensor held as `sharded(name)` is (a DTensor's local shard is taken)."""
        e = self.shadow[name]
        e.copy_(value if hasattr(e, "to_local") or not hasattr(value, "to_local") else value.to_local())

    @torch.no_grad()
    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        """Set the EMA from unsharded tensors (a checkpoint's), each sharded as its master is."""
        for name, layout in self.layout.items():
            value = full[name]
            if layout is not None:
                from torch.distributed.tensor import distribute_tensor

                mesh, placements, _, _ = layout
                value = distribute_tensor(value.to(mesh.device_type), mesh, placements)
            self.load_(name, value)

    @torch.no_grad()
    def full_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Unsharded copies (a collective under FSDP2: every rank calls it), in `dtype` if given."""
        out = {}
        for name in self.shadow:
            e = self.sharded(name)
            full = e.full_tensor() if hasattr(e, "full_tensor") else e.clone()
            out[name] = full.to(dtype) if dtype is not None else full
        return out


def _layout(p: torch.Tensor) -> tuple | None:
    d = cast("DTensor", p)  # read only where it has a device mesh: a DTensor
    return (d.device_mesh, d.placements, p.shape, p.stride()) if hasattr(p, "device_mesh") else None


def _offloaded(p: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the local shard of `p` (of `p` itself if it is a plain tensor)."""
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.detach().to("cpu", copy=True)
