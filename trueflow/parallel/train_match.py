"""The TP-matched train side: diffusers' own model, each planned linear layer computing its output as the engine's
N ranks do (same GEMM shapes, dtype, contiguity and bias placement), then concatenated (column-parallel) or summed
in rank order (row-parallel, `comm.rank_order_sum`, the engine's order). Applied to a built diffusers model by
replacing the forward of its `nn.Linear` / PEFT LoRA layers; everything else stays diffusers' code.

Attention runs as diffusers calls it, over all heads at once: each head's output depends on that head's q/k/v only
in SDPA's kernels (checked bit for bit on the CPU's flash and math kernels), so it is what the engine's ranks
compute over their head groups. A GPU run must confirm it for its kernel (docs/tensor-parallel.md).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .comm import rank_order_sum
from .plan import COLUMN, TPPlan, features_problem


def _parts(mod: nn.Module) -> tuple[nn.Linear, list[tuple[nn.Module, torch.Tensor, torch.Tensor, float]]]:
    """(base linear, [(dropout, A, B, scale)] of the active PEFT adapters, in PEFT's order)."""
    if not hasattr(mod, "base_layer"):
        return mod, []
    if getattr(mod, "merged", False):
        raise ValueError("the TP-matched train side needs LoRA unmerged (PEFT's merge_adapter was called)")
    if getattr(mod, "disable_adapters", False):
        return mod.base_layer, []
    return mod.base_layer, [(mod.lora_dropout[a], mod.lora_A[a].weight, mod.lora_B[a].weight, mod.scaling[a])
                            for a in mod.active_adapters if a in mod.lora_A]


def _column_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The engine's ranks, each `F.linear(x, W_r, b_r) + B_r(A x)·s` on its output rows, then concatenated."""
    base, loras = _parts(self)
    W, b, n = base.weight, base.bias, base.weight.shape[0] // self._tp_size
    outs = []
    for r in range(self._tp_size):
        rows = slice(r * n, (r + 1) * n)
        y = F.linear(x, W[rows], None if b is None else b[rows])
        for dropout, A, B, s in loras:
            y = y + F.linear(F.linear(dropout(x), A), B[rows]) * s
        outs.append(y)
    return torch.cat(outs, dim=-1)


def _row_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The engine's ranks, each `F.linear(x_r, W_r, b if r == 0) + B(A_r x_r)·s` on its contiguous input columns
    (the bias once, in rank 0's GEMM), then summed in rank order."""
    base, loras = _parts(self)
    W, b, n = base.weight, base.bias, base.weight.shape[1] // self._tp_size
    parts = []
    for r in range(self._tp_size):
        cols = slice(r * n, (r + 1) * n)
        x_r = x[..., cols].contiguous()
        y = F.linear(x_r, W[:, cols].contiguous(), b if r == 0 else None)
        for dropout, A, B, s in loras:
            y = y + F.linear(F.linear(dropout(x)[..., cols].contiguous(), A[:, cols].contiguous()), B) * s
        parts.append(y)
    return rank_order_sum(parts)


def match_tp(model: nn.Module, plan: TPPlan, tp: int) -> list[str]:
    """Make a diffusers model compute each planned linear layer as `tp` engine ranks do. Returns the layers' names.
    Checked first (the plan's head count, every layer's shape), applied only if all divide."""
    plan.check(dict(model.config), tp)
    found, problems = [], []
    for name, mod in model.named_modules():
        kind = plan.kind(name)
        if kind is None or not isinstance(_parts(mod)[0], nn.Linear):
            continue
        base = _parts(mod)[0]
        if problem := features_problem(name, kind, base.in_features, (base.out_features,), tp):
            problems.append(problem)
        found.append((name, mod, kind))
    if problems:
        raise ValueError("; ".join(problems))
    for _, mod, kind in found:
        mod._tp_size = tp
        mod.forward = types.MethodType(_column_forward if kind == COLUMN else _row_forward, mod)
    return [name for name, _, _ in found]
