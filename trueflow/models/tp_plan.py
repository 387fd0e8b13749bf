"""A tensor-parallel shard plan, declared as data by a model family (`EngineSide.tp_plan`), in diffusers' module names
so that the engine (through the family's name map) and the train side (`parallel.train_match`) read the same plan.
Data only: `trueflow.parallel` applies it.

Column-parallel: a rank holds a contiguous 1/N of the output features (of q/k/v: whole heads) and computes its share
of the output; nothing is reduced. Row-parallel: a rank holds 1/N of the input features, which are its share of the
column-parallel output before it; the partial outputs are summed across ranks. Gathered: a module that reads every
head at once (LTX-2.3's q/k norm across heads, its attention gate): each rank all-gathers its inputs' heads, runs the
module whole, as the train side does, and keeps its own heads of the output. Gathered inputs: a module that reads
column-parallel outputs and computes on all of them (FLUX's single-stream `proj_out`, whose input concatenates the
attention output and the MLP activation): its inputs all-gathered, run whole on every rank, its output kept whole.
Everything else is replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class TPPlan:
    column: tuple[str, ...]  # regexes, matched whole against diffusers module names: output features split
    row: tuple[str, ...]  # input features split; each rank's partial output summed in rank order
    heads: str  # the transformer config key counting the attention heads that the column-parallel q/k/v split
    # Modules whose tensor inputs hold a rank's heads on dim 2 ([B, S, H/N·D] or [B, S, H/N, ...]) but which compute
    # across heads: inputs all-gathered in rank order, the module run whole, the output's dim 2 sliced back.
    gathered: tuple[str, ...] = ()
    # Modules each of whose tensor inputs holds a rank's share on dim 2 (a column-parallel output): inputs
    # all-gathered in rank order, the module run whole and its output kept whole, the same on every rank.
    gathered_inputs: tuple[str, ...] = ()

    def kind(self, module: str) -> str | None:
        """COLUMN, ROW or None (replicated) for a diffusers module name."""
        if any(re.fullmatch(p, module) for p in self.column):
            return COLUMN
        if any(re.fullmatch(p, module) for p in self.row):
            return ROW
        return None

    def gathers(self, module: str) -> bool:
        return any(re.fullmatch(p, module) for p in self.gathered)

    def gathers_inputs(self, module: str) -> bool:
        return any(re.fullmatch(p, module) for p in self.gathered_inputs)

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
