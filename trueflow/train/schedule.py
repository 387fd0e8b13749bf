"""The learning-rate schedule and the EMA of the LoRA: both advance once per optimizer step and are saved in
checkpoints, so a resumed run continues them exactly."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

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


class LoraEMA:
    """An exponential moving average of the LoRA masters, `e ← d·e + (1 − d)·θ` after every optimizer step,
    starting from the initial weights (Polyak-Juditsky averaging in its exponential form, as in Karras et al.,
    EDM2, arXiv 2312.02696, Sec. 3.1). Kept in fp32 and sharded like the masters (FSDP2 DTensors)."""

    def __init__(self, params: dict[str, nn.Parameter], decay: float):
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, nn.Parameter]) -> None:
        for name, p in params.items():
            self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)

    @torch.no_grad()
    def full_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Unsharded copies (a collective under FSDP2: every rank calls it), in `dtype` if given."""
        out = {}
        for name, e in self.shadow.items():
            full = e.full_tensor() if hasattr(e, "full_tensor") else e.clone()
            out[name] = full.to(dtype) if dtype is not None else full
        return out
