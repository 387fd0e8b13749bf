"""Linear layers with LoRA: merged into the weight (the fast default) or kept unmerged.

A packed layer (q/k/v in one weight) holds one adapter slot per packed projection. LoRA names, shapes and
scales are those of PEFT: delta = B(A x) · scale, scale = alpha / rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LoraAdapter:
    A: torch.Tensor  # [rank, in_features]
    B: torch.Tensor  # [out_features of the slot, rank]
    scale: float


def lora_delta_reference(x: torch.Tensor, lora: LoraAdapter) -> torch.Tensor:
    """PEFT's vanilla LoRA: lora_B(lora_A(x)) * scaling, each step in the compute dtype."""
    return F.linear(F.linear(x, lora.A), lora.B) * lora.scale


class Linear(nn.Module):
    """y = x Wᵀ + b. More than one split packs several projections (q, k, v) into one weight and returns one tensor per
    split; `unpacked = True` runs one GEMM per split instead (what a reference with separate layers does)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, splits: tuple[int, ...] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.splits = tuple(splits) if splits else (out_features,)
        if sum(self.splits) != out_features:
            raise ValueError(f"splits {self.splits} must sum to out_features {out_features}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.unpacked = False
        self.adapters: list[LoraAdapter | None] = [None] * len(self.splits)  # the installed LoRA, per split
        self.base_weight: torch.Tensor | None = None  # the un-merged weight while the LoRA is merged into `weight`

    @property
    def merged(self) -> bool:
        return self.base_weight is not None

    @property
    def packed(self) -> bool:
        return len(self.splits) > 1

    def _slot(self, i: int) -> slice:
        start = sum(self.splits[:i])
        return slice(start, start + self.splits[i])

    def forward(self, x: torch.Tensor):
        adapters: list[LoraAdapter | None] = [None] * len(self.splits) if self.merged else self.adapters
        if self.packed and self.unpacked:
            slots = []
            for i in range(len(self.splits)):
                s = self._slot(i)
                # The bias stays in the GEMM call: F.linear(x, W, b) is not bitwise F.linear(x, W) + b.
                y = F.linear(x, self.weight[s], None if self.bias is None else self.bias[s])
                slots.append(y if (a := adapters[i]) is None else y + lora_delta_reference(x, a))
            return tuple(slots)
        y = F.linear(x, self.weight, self.bias)
        outs = y.split(self.splits, dim=-1) if self.packed else (y,)
        outs = tuple(o if a is None else o + lora_delta_reference(x, a) for o, a in zip(outs, adapters))
        return outs if self.packed else outs[0]

    # -- weight updates -------------------------------------------------------------------------------------
    @torch.no_grad()
    def set_lora(self, adapters: list[LoraAdapter | None], merge: bool) -> None:
        """Replace this layer's LoRA. Merged: W = W_base + scale·B·A, formed in fp32 and rounded once (the
        serving-engine merge). Unmerged: the adapters are kept and evaluated in every forward.

        An unmerged update over unmerged adapters of the same slots, shapes, dtypes, devices and scales is copied
        into the installed tensors (and list) in place: a captured CUDA graph reads them by address, so it stays
        valid (`engine.cuda_graph.LoraState`). Anything else installs `adapters` as a new list, which drops the
        graphs."""
        if not merge and self._fits_in_place(adapters):
            for old, new in zip(self.adapters, adapters):
                if old is not None and new is not None:  # None in the same slots (`_fits_in_place`)
                    old.A.copy_(new.A)
                    old.B.copy_(new.B)
            return
        self.clear_lora()
        self.adapters = list(adapters)
        if not merge:
            return
        self.base_weight = self.weight.detach().clone()
        merged = self.weight.float()
        for i, a in enumerate(adapters):
            if a is not None:
                merged[self._slot(i)] += a.scale * (a.B.float() @ a.A.float())
        self.weight.copy_(merged.to(self.weight.dtype))

    def hold_lora(self, adapters: list[LoraAdapter | None]) -> None:
        """Keep `adapters` unmerged as they are, without copying (views into an engine-held arena,
        `engine.lora_arena`): a new list, so captured CUDA graphs of the old tensors are dropped once."""
        self.clear_lora()
        self.adapters = list(adapters)

    def _fits_in_place(self, adapters: list[LoraAdapter | None]) -> bool:
        def same(a: torch.Tensor, b: torch.Tensor) -> bool:
            return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device

        return (not self.merged and any(self.adapters) and len(adapters) == len(self.adapters)
                and all((old is None) == (new is None) and (old is None or new is None or (
                    same(old.A, new.A) and same(old.B, new.B) and old.scale == new.scale))
                        for old, new in zip(self.adapters, adapters)))

    @torch.no_grad()
    def clear_lora(self) -> None:
        if self.base_weight is not None:
            self.weight.copy_(self.base_weight)
            self.base_weight = None
        self.adapters = [None] * len(self.splits)
