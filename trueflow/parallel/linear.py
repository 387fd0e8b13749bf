"""Sharded linear layers, built from a full engine `Linear` (shapes only) and holding one rank's share of it.

Both keep `Linear`'s forward for their local GEMM and LoRA: merged (`W_r + s·B_r·A` / `W_r + s·B·A_r`, formed per
shard) or unmerged in PEFT's order `F.linear(x, W_r, b_r) + s·B(A x)` on the shard. That is the TP-aware LoRA
forward: a column-parallel rank adds its rows of the delta, a row-parallel rank its share `s·B(A_r x_r)` before the
reduction, so that the sum over ranks holds every share once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.linear import Linear
from .comm import TPGroup, gather_sum


class ColumnParallelLinear(Linear):
    """Output rows of each packed split `r/N .. (r+1)/N` (whole heads for q/k/v); the output stays sharded."""

    def __init__(self, full: Linear, tp: TPGroup):
        super().__init__(full.in_features, full.out_features // tp.size, full.bias is not None,
                         tuple(s // tp.size for s in full.splits) if full.packed else None)
        self.tp = tp


class RowParallelLinear(Linear):
    """Input columns `r/N .. (r+1)/N`; the partial outputs are summed across ranks in rank order. The bias lives
    on rank 0 only, inside its GEMM call (`F.linear(x_0, W_0, b)`), so it is added once."""

    def __init__(self, full: Linear, tp: TPGroup):
        if full.packed:
            raise ValueError("a packed linear layer cannot be row-parallel: its splits are outputs")
        super().__init__(full.in_features // tp.size, full.out_features, full.bias is not None and tp.rank == 0)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_sum(super().forward(x), self.tp)


def sharded(full: Linear, kind: str, tp: TPGroup) -> Linear:
    """The rank's sharded layer for `full`, on its device and in its dtype (parameters unset; loaded after)."""
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    with torch.device(full.weight.device):
        layer = cls(full, tp)
    layer.unpacked = full.unpacked
    return layer.to(full.weight.dtype).requires_grad_(False)


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)
