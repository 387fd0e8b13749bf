"""Applying a family's tensor-parallel shard plan (`models.tp_plan.TPPlan`, declared as data in the family spec) to
tensors: which layers divide, and each rank's slice of the diffusers-named tensors."""

from __future__ import annotations

import re

import torch

from ..models.tp_plan import COLUMN, TPPlan


def features_problem(module: str, kind: str, in_features: int, splits: tuple[int, ...], tp: int) -> str | None:
    """Why a linear layer of this shape cannot be split `tp` ways, or None."""
    sizes = splits if kind == COLUMN else (in_features,)
    if any(s % tp for s in sizes):
        what = "output features" if kind == COLUMN else "input features"
        return (f"{module}: its {what} {'/'.join(map(str, sizes))} do not divide over --tp {tp}; choose a --tp "
                f"that divides them")
    return None


def shard(kind: str, tensor_kind: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor | None:
    """Rank `rank`'s copy of a full tensor of a sharded layer; `tensor_kind` is weight, bias, lora_A or lora_B.
    None: the rank holds none (a row-parallel bias lives on rank 0 only, which adds it once, in its own GEMM).

    Column: weight, bias and lora_B by output rows (lora_A whole: every rank needs A x). Row: weight and lora_A by
    input columns (lora_B whole: B (A_r x_r) is the rank's share of the delta, added before the reduction).
    Packed layers (q/k/v in one weight) are never sharded whole: each diffusers tensor is one projection."""
    def part(dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[rank].contiguous().clone()

    if kind == COLUMN:
        return t.contiguous().clone() if tensor_kind == "lora_A" else part(0)
    if tensor_kind == "bias":
        return t.contiguous().clone() if rank == 0 else None
    return t.contiguous().clone() if tensor_kind == "lora_B" else part(1)


_TENSOR = re.compile(r"^(?P<prefix>base_model\.model\.|transformer\.)?(?P<module>.+?)\."
                     r"(?:(?P<lora>lora_[AB])(?:\.default)?\.weight|(?P<param>weight|bias))$")


def shard_state_dict(plan: TPPlan, state_dict: dict[str, torch.Tensor], rank: int,
                     tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of diffusers-named tensors: full weights (`M.weight`, `M.bias`) or a PEFT LoRA
    (`M.lora_A.weight`, with PEFT's and diffusers' prefixes), under the same names; replicated tensors whole."""
    return {name: part for name, t in state_dict.items() if (part := shard_tensor(plan, name, t, rank, tp)) is not None}


def shard_tensor(plan: TPPlan, name: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor | None:
    """Rank `rank`'s part of the diffusers-named tensor `name` (the tensor itself where it is replicated)."""
    m = _TENSOR.match(name)
    kind = plan.kind(m.group("module")) if m else None
    return t if kind is None or m is None else shard(kind, m.group("lora") or m.group("param"), t, rank, tp)
