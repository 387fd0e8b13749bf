"""Linear layers with LoRA: merged into the weight (the fast default) or kept unmerged.

A packed layer (q/k/v in one weight) holds one adapter slot per packed projection. LoRA names, shapes and
scales are those of PEFT: delta = B(A x) · scale, scale = alpha / rank.

A layer may run on weights it does not own (`borrowed`: the train side's frozen base, `engine.weights.share_engine_
transformer`): it then never writes them (no merged LoRA), and a packed layer that runs one GEMM per split holds each
split's weight and bias apart (`hold_apart`), as the separate tensors they are on the train side.
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
        self.borrowed = False  # the weights are another model's (`hold_apart`, or shared as they are): never written
        self.apart = False  # each split's weight and bias are parameters of their own (`hold_apart`)

    @property
    def merged(self) -> bool:
        return self.base_weight is not None

    @property
    def packed(self) -> bool:
        return len(self.splits) > 1

    def _slot(self, i: int) -> slice:
        start = sum(self.splits[:i])
        return slice(start, start + self.splits[i])

    def slot_params(self, i: int) -> list[tuple[str, nn.Parameter, slice | None]]:
        """(weight|bias, the parameter, its rows for split `i` or None) of split `i`: rows of the packed parameters,
        or the split's own parameters once held apart."""
        if self.apart:
            return [(kind, getattr(self, f"{kind}_{i}"), None) for kind in ("weight", "bias")
                    if getattr(self, f"{kind}_{i}", None) is not None]
        return [(kind, p, self._slot(i) if self.packed else None) for kind, p in (("weight", self.weight),
                                                                                 ("bias", self.bias)) if p is not None]

    def slot_weight(self, i: int) -> torch.Tensor:
        """Split `i`'s weight rows (a view, or the split's own weight once held apart)."""
        _, p, rows = self.slot_params(i)[0]
        return p if rows is None else p[rows]

    @property
    def dtype(self) -> torch.dtype:
        return self.slot_weight(0).dtype

    @property
    def device(self) -> torch.device:
        return self.slot_weight(0).device

    @property
    def weights_version(self) -> tuple[int, ...]:
        """The in-place versions of the weights: what changes when anything writes into them."""
        return tuple(p._version for p in self.parameters(recurse=False))

    def hold_apart(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        """Run each split from its own weight and bias (`weight_i`, `bias_i`), given tensors kept as they are (no
        copy: another model's, `borrowed`), in place of the packed `weight` and `bias`, which are dropped. Only a
        layer that runs one GEMM per split (`unpacked`) can: a packed GEMM needs its splits in one buffer."""
        if not (self.packed and self.unpacked):
            raise ValueError("only a packed layer that runs one GEMM per split (unpacked) can hold its splits apart")
        if self.adapters != [None] * len(self.splits) or self.merged:
            raise ValueError("hold_apart before any LoRA is installed")
        if any((b is None) != (self.bias is None) for b in biases):
            raise ValueError("hold_apart takes a bias for every split of a layer with a bias, and none otherwise")
        del self.weight, self.bias
        for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
            self.register_parameter(f"weight_{i}", nn.Parameter(w, requires_grad=False))
            self.register_parameter(f"bias_{i}", None if b is None else nn.Parameter(b, requires_grad=False))
        self.apart = self.borrowed = True

    def forward(self, x: torch.Tensor):
        adapters: list[LoraAdapter | None] = [None] * len(self.splits) if self.merged else self.adapters
        if self.packed and self.unpacked:
            slots = []
            for i in range(len(self.splits)):
                params = {kind: p if rows is None else p[rows] for kind, p, rows in self.slot_params(i)}
                # The bias stays in the GEMM call: F.linear(x, W, b) is not bitwise F.linear(x, W) + b.
                y = F.linear(x, params["weight"], params.get("bias"))
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
        if merge and self.borrowed:  # `weight_map.set_lora` refuses such an update before it installs anything
            raise ValueError("a merged LoRA would write into weights this layer borrows (the train side's base)")
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
