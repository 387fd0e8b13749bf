"""Per-layer divergence between the train-side model and the engine: forward hooks on both sides, aligned by
diffusers module name, compared in the train side's execution order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.linear import Linear
from ..models.spec import ModelFamily


@dataclass
class LayerDiff:
    module: str
    max_abs_diff: float
    mean_abs_diff: float


def _tensors(out) -> tuple[torch.Tensor, ...]:
    """A module's tensor outputs; a None in a tuple (SD3's last block returns no text stream) is no output."""
    return tuple(o for o in out if o is not None) if isinstance(out, (tuple, list)) else (out,)


@contextmanager
def capture(model: nn.Module, names: Mapping[str, Sequence[tuple[str, int | None]]]):
    """Record outputs of `model`'s modules: names maps module name -> [(report name, element index or None)].
    Yields a dict report name -> tensor, in execution order, filled when the block ends. A module called once per
    micro-batch has its calls' outputs joined along the batch (dim 0), as one call on the whole batch gives them."""
    seen: dict[str, torch.Tensor] = {}
    calls: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    handles = []
    modules = dict(model.named_modules())
    for mod_name, targets in names.items():
        def hook(_m, _inp, out, targets=targets):
            outs = _tensors(out)
            for report_name, index in targets:
                picked = outs if index is None else (outs[index],)
                calls.setdefault(report_name, []).append(tuple(o.detach() for o in picked))
        handles.append(modules[mod_name].register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
        # flattened, so a tuple output (a block's two streams) compares as one tensor and a packed slot as the
        # separate layer's output
        for report_name, outs in calls.items():
            seen[report_name] = torch.cat([torch.cat([c[j] for c in outs]).flatten() for j in range(len(outs[0]))])


LAYER_REPORTS = ("all", "blocks", "none")


def engine_targets(engine: nn.Module, family: ModelFamily,
                   layer_report: str = "all") -> dict[str, list[tuple[str, int | None]]]:
    """Engine module -> [(diffusers module name, output index)], one per packed slot for q/k/v layers, for the
    modules the family marks comparable. `blocks` keeps top-level modules and whole blocks only; `none` compares
    the model output alone (a video model's per-block outputs can outweigh its weights: Wan2.2 at 81 frames)."""
    if layer_report not in LAYER_REPORTS:
        raise ValueError(f"unknown layer report {layer_report!r}; choose one of {', '.join(LAYER_REPORTS)}")
    if layer_report == "none":
        return {}
    name_of, comparable = family.engine.diffusers_module_name, family.engine.comparable_modules
    block_prefixes = tuple(f"{b}." for b in family.blocks)
    out: dict[str, list[tuple[str, int | None]]] = {}
    for name, mod in engine.named_modules():
        if layer_report == "blocks" and name.count(".") > (1 if name.startswith(block_prefixes) else 0):
            continue
        if isinstance(mod, comparable) and name:
            if isinstance(mod, Linear) and mod.packed:
                out[name] = [(name_of(name, i), i) for i in range(len(mod.splits))]
            else:
                out[name] = [(name_of(name), None)]
    return out


def compare(train_out: dict[str, torch.Tensor], engine_out: dict[str, torch.Tensor]) -> list[LayerDiff]:
    """Differences for the names both sides recorded, in the train side's execution order."""
    rows = []
    for name, t in train_out.items():
        e = engine_out.get(name)
        if e is None or e.shape != t.shape:
            continue
        d = (e.float() - t.float()).abs()
        rows.append(LayerDiff(name, d.max().item(), d.mean().item()))
    return rows
