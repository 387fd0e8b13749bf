"""A tensor-parallel shard plan, declared as data by a model family (`EngineSide.tp_plan`), in diffusers' module names
so that the engine (through the family's name map) and the train side (`train_match`) read the same plan.

Column-parallel: a rank holds a contiguous 1/N of the output features (of q/k/v: whole heads) and computes its share
of the output; nothing is reduced. Row-parallel: a rank holds 1/N of the input features, which are its share of the
column-parallel output before it; the partial outputs are summed across ranks. Gathered: a module that reads every
head at once (LTX-2.3's q/k norm across heads, its attention gate): each rank all-gathers its inputs' heads, runs the
module whole, as the train side does, and keeps its own heads of the output. Everything else is replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class TPPlan:
    column: tuple[str, ...]  # regexes, matched whole against diffusers module names: output features split
    row: tuple[str, ...]  # input features split; each rank's partial output summed in rank order
    heads: str  # the transformer config key counting the attention heads that the column-parallel q/k/v split
    # Modules whose tensor inputs hold a rank's heads on dim 2 ([B, S, H/N·D] or [B, S, H/N, ...]) but which compute
    # across heads: inputs all-gathered in rank order, the module run whole, the output's dim 2 sliced back.
    gathered: tuple[str, ...] = ()

    def kind(self, module: str) -> str | None:
        """COLUMN, ROW or None (replicated) for a diffusers module name."""
        if any(re.fullmatch(p, module) for p in self.column):
            return COLUMN
        if any(re.fullmatch(p, module) for p in self.row):
            return ROW
        return None

    def gathers(self, module: str) -> bool:
        return any(re.fullmatch(p, module) for p in self.gathered)

    def unmatched(self, modules: list[str], patterns: tuple[str, ...] | None = None) -> list[str]:
        """The plan's patterns (default: the linear layers') that name none of `modules` (a typo in a plan would
        leave a layer whole)."""
        return [p for p in (self.column + self.row if patterns is None else patterns)
                if not any(re.fullmatch(p, m) for m in modules)]

    def check(self, config: dict, tp: int) -> None:
        """Refuse a degree that does not split the heads whole (one line naming the degrees that do)."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"--tp must be a positive integer, got {tp!r}")
        heads = int(config[self.heads])
        if heads % tp:
            fits = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"--tp {tp} does not divide the {heads} attention heads ({self.heads}); choose --tp "
                             f"among {', '.join(map(str, fits))}")


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
    return t if kind is None else shard(kind, m.group("lora") or m.group("param"), t, rank, tp)
