"""The TP-matched train side: diffusers' own model, each planned linear layer computing its output as the engine's
N ranks do (same GEMM shapes, dtype, contiguity and bias placement), then concatenated (column-parallel) or summed
in rank order (row-parallel, `comm.rank_order_sum`, the engine's order). Applied to a built diffusers model by
replacing the forward of its `nn.Linear` / PEFT LoRA layers; everything else stays diffusers' code.

Attention runs over the engine's head groups: the processor of each attention module whose q projection is
column-parallel calls diffusers' attention dispatch (or PyTorch's SDPA, for a processor that calls it itself) once per
group of H/N heads (contiguous, as a rank hands its own q/k/v to the kernel), and concatenates the outputs along the
heads. On the CPU's flash and math kernels a
head's output does not depend on the other heads anyway (checked bit for bit); a GPU kernel chosen by shape
(cuDNN's) might.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .comm import rank_order_sum
from ..models.tp_plan import COLUMN, TPPlan
from .plan import features_problem


def _parts(mod: nn.Module) -> tuple[nn.Module, list[tuple[nn.Module, torch.Tensor, torch.Tensor, float]]]:
    """(base linear, [(dropout, A, B, scale)] of the active PEFT adapters, in PEFT's order)."""
    if not hasattr(mod, "base_layer"):
        return mod, []
    peft: Any = mod  # a PEFT LoRA layer (it has `base_layer`): nn.Module types its adapter dicts as tensors/modules
    if getattr(mod, "merged", False):
        raise ValueError("the TP-matched train side needs LoRA unmerged (PEFT's merge_adapter was called)")
    if getattr(mod, "disable_adapters", False):
        return peft.base_layer, []
    return peft.base_layer, [(peft.lora_dropout[a], peft.lora_A[a].weight, peft.lora_B[a].weight, peft.scaling[a])
                             for a in peft.active_adapters if a in peft.lora_A]


def _column_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The engine's ranks, each `F.linear(x, W_r, b_r) + B_r(A x)·s` on its output rows, then concatenated."""
    base, loras = _parts(self)
    assert isinstance(base, nn.Linear)  # match_tp planned only linear layers
    tp_size = cast(int, self._tp_size)  # set by match_tp (nn.Module types unknown attributes as tensors/modules)
    W, b, n = base.weight, base.bias, base.weight.shape[0] // tp_size
    outs = []
    for r in range(tp_size):
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
    assert isinstance(base, nn.Linear)  # match_tp planned only linear layers
    tp_size = cast(int, self._tp_size)  # set by match_tp (nn.Module types unknown attributes as tensors/modules)
    W, b, n = base.weight, base.bias, base.weight.shape[1] // tp_size
    parts = []
    for r in range(tp_size):
        cols = slice(r * n, (r + 1) * n)
        x_r = x[..., cols].contiguous()
        y = F.linear(x_r, W[:, cols].contiguous(), b if r == 0 else None)
        for dropout, A, B, s in loras:
            y = y + F.linear(F.linear(dropout(x)[..., cols].contiguous(), A[:, cols].contiguous()), B) * s
        parts.append(y)
    return rank_order_sum(parts)


class _Functional:
    """`torch.nn.functional` with another `scaled_dot_product_attention`: what a processor module that calls
    `F.scaled_dot_product_attention` itself finds as its `F` while its heads are grouped."""

    def __init__(self, sdpa):
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name: str):
        return getattr(F, name)


def _calls_sdpa(module: types.ModuleType) -> bool:
    """Whether a processor's module reaches attention through diffusers' dispatch or PyTorch's SDPA (`F`) itself
    (`JointAttnProcessor2_0`, SD3's), the two calls `_head_groups` can group."""
    return hasattr(module, "dispatch_attention_fn") or getattr(module, "F", None) is F


def _head_groups(processor, tp: int):
    """`processor` (diffusers' attention processor of a module whose heads are split) calling its attention once per
    head group. The processor finds `dispatch_attention_fn` (q/k/v [B, S, H, D], heads on dim 2), or `F` whose
    `scaled_dot_product_attention` it calls itself (q/k/v [B, H, S, D], heads on dim 1), in its module's globals at
    call time, so the grouped function stands in there for the duration of the call (the forward is single-threaded;
    a recompute under gradient checkpointing calls the processor again)."""
    module = module_of(processor)
    name, heads = ("dispatch_attention_fn", 2) if hasattr(module, "dispatch_attention_fn") else ("F", 1)

    base: Any = type(processor)  # diffusers' processor class, known at run time only

    class HeadGroups(base):
        @functools.wraps(base.__call__)  # diffusers passes only the keywords the processor's signature names
        def __call__(self, *args, **kwargs):
            original = getattr(module, name)
            attend = original if name == "dispatch_attention_fn" else original.scaled_dot_product_attention

            def grouped(query, key, value, *a, **kw):
                masks = [kw.get("attn_mask")] * tp
                if masks[0] is not None and masks[0].dim() == 4 and masks[0].shape[1] == query.shape[heads] > 1:
                    # a per-head mask [B, H, ., L] (LTX-2.3's text bias): each group its heads' rows, as a rank's own
                    masks = [m.contiguous() for m in masks[0].chunk(tp, dim=1)]
                groups = zip(*(t.chunk(tp, dim=heads) for t in (query, key, value)), masks)
                return torch.cat([attend(q.contiguous(), k.contiguous(), v.contiguous(), *a,
                                         **(kw | ({} if m is None else {"attn_mask": m})))
                                  for q, k, v, m in groups], dim=heads)

            setattr(module, name, grouped if name == "dispatch_attention_fn" else _Functional(grouped))
            try:
                return super().__call__(*args, **kwargs)
            finally:
                setattr(module, name, original)

    grouped_processor = HeadGroups.__new__(HeadGroups)
    grouped_processor.__dict__.update(processor.__dict__)  # the backend diffusers set on it, and the rest
    return grouped_processor


def match_tp(model: nn.Module, plan: TPPlan, tp: int) -> list[str]:
    """Make a diffusers model compute each planned linear layer, and attend over head groups, as `tp` engine ranks
    do. Returns the layers' names. Checked first (the plan's head count, its patterns, every layer's shape, every
    split attention's processor), applied only if all hold."""
    if getattr(model, "_trueflow_tp_match", None) is not None:
        raise ValueError(f"this model is already TP-matched ({model._trueflow_tp_match} ranks)")
    plan.check(dict(cast(Mapping[str, Any], model.config)), tp)  # a diffusers model's config (ConfigMixin's)
    modules = dict(model.named_modules())
    linears = {name: base for name, mod in modules.items() if isinstance(base := _parts(mod)[0], nn.Linear)}
    found = [(name, kind) for name in linears if (kind := plan.kind(name)) is not None]
    problems = [p for name, kind in found
                if (p := features_problem(name, kind, linears[name].in_features, (linears[name].out_features,), tp))]
    problems += [f"the TP plan's pattern {p!r} names no linear layer of this model"
                 for p in plan.unmatched(list(linears))]
    attentions = [mod for name, mod in modules.items()  # attention modules whose q projection is split by heads
                  if hasattr(mod, "processor") and hasattr(mod, "to_q") and plan.kind(f"{name}.to_q") == COLUMN]
    problems += [f"attention processor {type(mod.processor).__name__} calls neither diffusers' dispatch_attention_fn "
                 "nor PyTorch's SDPA: its heads cannot be grouped as the engine's ranks" for mod in attentions
                 if not _calls_sdpa(module_of(mod.processor))]
    if problems:
        raise ValueError("; ".join(problems))
    for name, kind in found:
        modules[name]._tp_size = tp
        modules[name].forward = types.MethodType(_column_forward if kind == COLUMN else _row_forward, modules[name])
    for mod in attentions:
        mod.set_processor(_head_groups(mod.processor, tp))
    model._trueflow_tp_match = tp  # type: ignore[assignment]  # torch's stub types Module.__setattr__ values as Tensor | Module; any object is set
    return [name for name, _ in found]


def module_of(processor) -> types.ModuleType:
    return sys.modules[type(processor).__module__]
