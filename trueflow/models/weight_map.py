"""Loading diffusers-named tensors into an engine model, for any family: full weights and PEFT LoRA, checked all
at once (names, shapes, and values as the engine's dtype holds them) and applied only when everything is valid.

A family supplies only its name map (`Names`): diffusers module name <-> (engine module name, packed slot). Pure
name/shape logic and tensor copies, no file I/O (`trueflow.loading` reads the files).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

import torch
from torch import nn

from ..layers.linear import Linear, LoraAdapter


class Names(NamedTuple):
    """A family's module-name map. Names not renamed are the same on both sides."""

    map_module_name: Callable[[str], tuple[str, int | None]]  # diffusers module -> (engine module, packed slot)
    diffusers_module_name: Callable[..., str]  # (engine module, slot=None) -> diffusers module: the inverse


SAME_NAMES = Names(lambda name: (name, None), lambda name, slot=None: name)

BLOCK = re.compile(r"^(transformer_blocks\.\d+\.)(.+)$")  # a block's prefix, kept by a rename, and the rest


def renamed(block: dict[str, tuple[str, int | None]], top: dict[str, tuple[str, int | None]],
            reverse_block: dict[tuple[str, int | None], str] | None = None,
            lists: dict[str, dict[str, tuple[str, int | None]]] | None = None) -> Names:
    """The name map of rename tables: diffusers name -> (engine name, packed slot), inside a block (the
    `transformer_blocks.N.` prefix kept) and at the top level; names not listed are the same on both sides. The
    inverse is the tables reversed, plus `reverse_block` (engine names no forward entry produces). `lists`: the
    renames inside the blocks of other ModuleLists, by list name (FLUX's `single_transformer_blocks`)."""
    tables = {"transformer_blocks": block, **(lists or {})}
    backs = {name: {v: k for k, v in table.items()} for name, table in tables.items()}
    backs["transformer_blocks"] |= reverse_block or {}
    back_top = {v: k for k, v in top.items()}
    pattern = re.compile(rf"^(({'|'.join(map(re.escape, tables))})\.\d+\.)(.+)$")

    def map_module_name(diffusers_name: str) -> tuple[str, int | None]:
        m = pattern.match(diffusers_name)
        if m:
            engine, slot = tables[m.group(2)].get(m.group(3), (m.group(3), None))
            return m.group(1) + engine, slot
        return top.get(diffusers_name, (diffusers_name, None))

    def diffusers_module_name(engine_name: str, slot: int | None = None) -> str:
        m = pattern.match(engine_name)
        if m:
            return m.group(1) + backs[m.group(2)].get((m.group(3), slot), m.group(3))
        return back_top.get((engine_name, slot), engine_name)

    return Names(map_module_name, diffusers_module_name)


class OwnedWeights(dict):
    """A full-weight state dict whose tensors the sender gives up (it made them for this update: gathered, cast
    copies, never read or written again by it), so an engine in the sender's process may keep them as its parameters
    instead of copying them (`load_weights`). Another placement packs the state into buckets (`sync.buckets`): the
    mark does not travel, and the receiver copies out of the buffers it was sent."""


class WeightLoadError(ValueError):
    """Raised with every missing, unexpected, mis-shaped and refused tensor listed at once; nothing was applied."""

    def __init__(self, missing: list[str], unexpected: list[str], mismatched: list[str], what: str = "weights",
                 refused: list[str] | None = None):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        self.refused = refused or []
        lines = [f"cannot load {what}, nothing was applied:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched),
                             ("refused values", self.refused)):
            if items:
                lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:50]) + " ..." * (len(items) > 50))
        if missing or unexpected or mismatched:
            lines.append("  (is this a transformer of the same family and config? `trueflow init-checkpoint` writes "
                         "one)")
        super().__init__("\n".join(lines))


# -- values: what the engine would hold after the cast to its dtype ------------------------------------------
def _largest(tensors: list[tuple[torch.Tensor, torch.dtype]]) -> list[tuple[float, float]]:
    """For each (tensor, dtype): (largest |value| of the tensor, the same once cast to `dtype`); inf or NaN in the
    second means the cast tensor holds one. Rounding is monotonic and min/max propagate NaN, so casting a
    tensor's two extremes decides it for every element, with no cast copy. One reduction per tensor on its
    device; the extremes reach the CPU in one transfer per (device, dtype): a sync per tensor would cost more
    than the update itself on a GPU."""
    out = [(0.0, 0.0)] * len(tensors)
    groups: dict[tuple, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for i, (t, dtype) in enumerate(tensors):
        if t.numel():
            groups.setdefault((t.device, t.dtype, dtype), []).append((i, *torch.aminmax(t.detach())))
    for (_, _, dtype), items in groups.items():
        ends = torch.stack([e for _, lo, hi in items for e in (lo, hi)]).cpu().view(-1, 2)
        given, cast = ends.double().abs().amax(1).tolist(), ends.to(dtype).double().abs().amax(1).tolist()
        for (i, _, _), g, c in zip(items, given, cast):
            out[i] = (g, c)
    return out


def _fits(value: float, dtype: torch.dtype) -> bool:
    """Whether a float64 value is finite once rounded to `dtype`."""
    return bool(torch.isfinite(torch.tensor(value, dtype=torch.float64).to(dtype)))


def _value_problem(name: str, given: float, cast: float, dtype: torch.dtype) -> str | None:
    """Why a tensor whose largest |value| is `given` (`cast` once cast to `dtype`) cannot be installed, or None."""
    if math.isfinite(cast):
        return None
    if not math.isfinite(given):
        return f"{name} holds {'NaN' if math.isnan(given) else 'inf'}"
    return f"{name} holds |value| {given:.4g}, inf in {_dtype_name(dtype)} (largest finite {_max(dtype):.4g})"


def _not_float(name: str, t: torch.Tensor) -> str | None:
    return None if t.is_floating_point() else f"{name} is {t.dtype}, not a floating-point tensor"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def expected_tensors(model: nn.Module, names: Names) -> dict[str, tuple[nn.Parameter, slice | None]]:
    """diffusers tensor name -> (engine parameter, row slice of it or None) for every engine parameter."""
    out: dict[str, tuple[nn.Parameter, slice | None]] = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.packed:  # its splits' rows, or their own parameters once held apart
            for i in range(len(mod.splits)):
                for kind, param, rows in mod.slot_params(i):
                    out[f"{names.diffusers_module_name(mod_name, i)}.{kind}"] = (param, rows)
            continue
        for p_name, param in mod.named_parameters(recurse=False):
            # a parameter of the root module (LTX-2's output modulation table) has no module prefix
            out[".".join(filter(None, (names.diffusers_module_name(mod_name), p_name)))] = (param, None)
    return out


def full_state(model: nn.Module, names: Names) -> dict[str, torch.Tensor]:
    """Every engine weight under its diffusers tensor name: the parameter itself, or the rows of a packed one (a
    view, no copy). What a full-weight update installed, read back (`sync.full_weights.weights_checksum`)."""
    return {name: param[rows] if rows is not None else param
            for name, (param, rows) in expected_tensors(model, names).items()}


def subset(state_dict: dict[str, torch.Tensor], keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The entries of `state_dict` whose names `keep` takes, in a dict of the same kind (an `OwnedWeights` stays
    one: its tensors may still be kept without a copy)."""
    return type(state_dict)((k, v) for k, v in state_dict.items() if keep(k))


@torch.no_grad()
def check_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], names: Names) -> None:
    """`load_weights`' checks alone: WeightLoadError listing every problem, nothing applied (an engine of several
    experts checks every expert's part before it loads any)."""
    expected = expected_tensors(model, names)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched, refused, to_check = [], [], []
    for name in sorted(set(expected) & set(state_dict)):
        param, rows = expected[name]
        want = tuple(param[rows].shape) if rows is not None else tuple(param.shape)
        if tuple(state_dict[name].shape) != want:
            mismatched.append(f"{name} {tuple(state_dict[name].shape)} != expected {want}")
        elif problem := _not_float(name, state_dict[name]):
            refused.append(problem)
        else:
            to_check.append((name, state_dict[name], param.dtype))
    ranges = _largest([(t, dtype) for _, t, dtype in to_check])
    refused += [p for (name, _, dtype), r in zip(to_check, ranges) if (p := _value_problem(name, *r, dtype))]
    if missing or unexpected or mismatched or refused:
        raise WeightLoadError(missing, unexpected, mismatched, refused=refused)


@torch.no_grad()
def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], names: Names) -> None:
    """Copy a diffusers-format transformer state dict into the engine model (cast to the model's dtype).
    Checks everything first, names, shapes and the values as the cast leaves them (a value finite in the file
    but inf in bf16 is refused): on any problem nothing is copied and one error lists all problems.

    An `OwnedWeights` state (the sender gave its tensors up) is installed without a copy where
    a tensor can *be* the parameter: same dtype, device and shape, contiguous, and not one slot of a packed weight
    (the engine's one q/k/v GEMM reads the three diffusers tensors from one buffer, so those are copied in)."""
    check_weights(model, state_dict, names)
    expected = expected_tensors(model, names)
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.clear_lora()  # a full-weight update replaces the base weights; adapters do not carry over
    owned = isinstance(state_dict, OwnedWeights)
    for name, (param, rows) in expected.items():
        t = state_dict[name]
        if owned and rows is None and t.dtype == param.dtype and t.device == param.device \
                and t.shape == param.shape and t.is_contiguous():
            param.data = t
        else:
            (param[rows] if rows is not None else param).copy_(t)


@torch.no_grad()
def share_weights(model: nn.Module, base: dict[str, torch.Tensor], names: Names,
                  device: torch.device) -> dict[str, str]:
    """Install another model's tensors (diffusers names: the train side's frozen base) as the weights of an engine
    model built on the meta device, without a copy wherever a tensor can *be* the parameter: same dtype and shape,
    on `device`, contiguous. A packed layer that runs one GEMM per split (`Linear.unpacked`, the parity groups'
    `unpacked_qkv`) holds its splits' tensors apart (`Linear.hold_apart`); one that runs the packed GEMM gets its
    own packed copy, and so does a tensor the engine holds in another dtype (a cast). Checked first as
    `load_weights` checks (names, shapes, values). Every layer that reads a shared tensor is marked `borrowed`, so
    it never writes into it. Returns the tensors copied: diffusers name -> why."""
    check_weights(model, base, names)
    own: dict[str, str] = {}

    def shareable(t: torch.Tensor, like: torch.Tensor) -> str | None:  # why not, or None
        if t.dtype != like.dtype:
            return f"cast {_dtype_name(t.dtype)} -> {_dtype_name(like.dtype)}"
        if t.device != device:
            return f"moved from {t.device} to the engine's {device}"
        return None if t.is_contiguous() else "made contiguous"

    def own_copy(param: nn.Parameter, parts: list[tuple[str, torch.Tensor]], why: str) -> nn.Parameter:
        own.update((name, why) for name, _ in parts)
        return nn.Parameter(torch.cat([t.to(device, param.dtype) for _, t in parts]) if len(parts) > 1 else
                            parts[0][1].to(device, param.dtype, copy=True), requires_grad=False)

    for mod_name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.packed:
            slots = [{kind: f"{names.diffusers_module_name(mod_name, i)}.{kind}" for kind, _, _ in mod.slot_params(i)}
                     for i in range(len(mod.splits))]
            whys = [w for slot in slots for kind, name in slot.items()
                    if (w := shareable(base[name], getattr(mod, kind)))]
            if mod.unpacked and not whys:
                mod.hold_apart([base[slot["weight"]].detach() for slot in slots],
                               [base[slot["bias"]].detach() if "bias" in slot else None for slot in slots])
                continue
            why = whys[0] if whys else "packed: the patch group runs one GEMM for its splits"
            for kind in slots[0]:
                setattr(mod, kind, own_copy(getattr(mod, kind), [(s[kind], base[s[kind]]) for s in slots], why))
            continue
        for p_name, param in list(mod.named_parameters(recurse=False)):
            name = ".".join(filter(None, (names.diffusers_module_name(mod_name), p_name)))
            reason = shareable(base[name], param)
            if reason is None:
                mod.register_parameter(p_name, nn.Parameter(base[name].detach(), requires_grad=False))
                if isinstance(mod, Linear):
                    mod.borrowed = True
            else:
                mod.register_parameter(p_name, own_copy(param, [(name, base[name])], reason))
    return own


T = TypeVar("T")  # what the names map to: tensors, or their shapes (`lora_files` reads a file's header)


def parse_peft_state_dict(state_dict: Mapping[str, T]) -> dict[str, tuple[T, T]]:
    """PEFT/diffusers LoRA tensors -> {diffusers module name: (A, B)}. Accepts the prefixes PEFT and diffusers
    write (`base_model.model.`, `transformer.`) and PEFT's `.default` adapter infix."""
    pairs: dict[str, dict[str, T]] = {}
    bad = []
    for key, t in state_dict.items():
        m = re.match(r"^(?:base_model\.model\.|transformer\.)?(.+)\.lora_([AB])(?:\.default)?\.weight$", key)
        if not m:
            bad.append(key)
            continue
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    incomplete = sorted(k for k, v in pairs.items() if set(v) != {"A", "B"})
    if bad or incomplete:
        raise WeightLoadError([f"{k}.lora_[AB].weight" for k in incomplete], bad, [], what="LoRA")
    return {k: (v["A"], v["B"]) for k, v in pairs.items()}


@torch.no_grad()
def set_lora(model: nn.Module, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, merge: bool,
             names: Names, check_only: bool = False) -> None:
    """Install a LoRA (diffusers module name -> (A, B)) on the engine, replacing any previous one. Validated
    first, applied only if valid, so a bad update leaves the previous weights in place. `check_only`: validate
    and stop (tensor-parallel ranks agree that every rank's slice is valid before any rank applies its own).

    Values are judged as the engine would hold them, in its dtype: A, B and the scale must be finite once cast,
    and so must scale·B (what an engine that folds the scale into B holds) and a bound of W + scale·B·A (the
    merged weight; checked in both merge modes, so that the mode never decides whether an update is taken)."""
    modules = dict(model.named_modules())
    if merge and any(isinstance(m, Linear) and m.borrowed for m in modules.values()):
        raise ValueError("a merged LoRA would write into the base weights this engine shares with the train side "
                         "(--share-base-weights): take LoRA updates unmerged (--lora-merge-mode unmerged)")
    unexpected, mismatched, refused = [], [], []
    floats: list[tuple[str, Linear, int, torch.Tensor, torch.Tensor, bool]] = []  # name, layer, slot, A, B, shaped
    for name, (A, B) in lora.items():
        engine_name, slot = names.map_module_name(name)
        layer = modules.get(engine_name)
        if not isinstance(layer, Linear):
            unexpected.append(name)
            continue
        slot = slot or 0
        rank = A.shape[0] if A.ndim == 2 else B.shape[1] if B.ndim == 2 else "rank"
        shapes = [f"{name}.lora_{ab}.weight {tuple(t.shape)} != expected ({rows}, {cols})"
                  for t, ab, (rows, cols) in ((A, "A", (rank, layer.in_features)), (B, "B", (layer.splits[slot], rank)))
                  if tuple(t.shape) != (rows, cols)]
        mismatched += shapes
        not_float = [p for t, ab in ((A, "A"), (B, "B")) if (p := _not_float(f"{name}.lora_{ab}.weight", t))]
        refused += not_float
        if not not_float:
            floats.append((name, layer, slot, A, B, not shapes))
    # One batch of reductions: each A and B, and the base rows the adapter merges into.
    ranges = _largest([(t, layer.dtype) for _, layer, slot, A, B, _ in floats
                       for t in (A, B, _base_rows(layer, slot))])
    scale_problem = _scale_problem(scale, {m.dtype for m in modules.values() if isinstance(m, Linear)})
    refused += [scale_problem] if scale_problem else []
    per_layer: dict[str, list] = {}
    for i, (name, layer, slot, A, B, shaped) in enumerate(floats):
        dtype = layer.dtype
        (given_a, a), (given_b, b), (_, w) = ranges[3 * i:3 * i + 3]
        values = [p for ab, given, cast in (("A", given_a, a), ("B", given_b, b))
                  if (p := _value_problem(f"{name}.lora_{ab}.weight", given, cast, dtype))]
        refused += values
        if shaped and not values and not scale_problem:
            refused += [p] if (p := _product_problem(name, dtype, float(scale), a, b, w, A.shape[0])) else []
        per_layer.setdefault(names.map_module_name(name)[0], [None] * len(layer.splits))[slot] = (name, A, B)
    if unexpected or mismatched or refused:
        raise WeightLoadError([], unexpected, mismatched, what="LoRA", refused=refused)
    if check_only:
        return
    # Cast copies first, so that nothing is installed unless every copy was made.
    adapters = {n: [None if s is None else _adapter(modules[n], s[1], s[2], float(scale)) for s in slots]
                for n, slots in per_layer.items()}
    for name, mod in modules.items():
        if isinstance(mod, Linear):
            if name in adapters:
                mod.set_lora(adapters[name], merge=merge)
            else:
                mod.clear_lora()


def _adapter(layer: Linear, A: torch.Tensor, B: torch.Tensor, scale: float) -> LoraAdapter:
    return LoraAdapter(A.to(layer.device, layer.dtype, copy=True), B.to(layer.device, layer.dtype, copy=True), scale)


# of the merged-weight bound below the dtype's range: room for fp32 rounding in the merge's sums
MERGE_MARGIN = 1 - 1e-3


def _scale_problem(scale: float, dtypes: set[torch.dtype]) -> str | None:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        return f"scale must be a number, got {type(scale).__name__}"
    for dtype in dtypes:
        if not _fits(float(scale), dtype):
            return f"scale {float(scale):.4g} is not finite in {_dtype_name(dtype)} (largest finite {_max(dtype):.4g})"
    return None


def _base_rows(layer: Linear, slot: int) -> torch.Tensor:
    """Split `slot`'s weight rows without any merged LoRA: what a new LoRA merges into."""
    if layer.merged:
        assert layer.base_weight is not None  # the merge kept it
        return layer.base_weight[layer._slot(slot)]
    return layer.slot_weight(slot)


def _product_problem(name: str, dtype: torch.dtype, scale: float, a: float, b: float, w: float,
                     rank: int) -> str | None:
    """Why scale·B or W + scale·B·A may not be finite in `dtype`, from the largest |value| of the cast A (`a`),
    B (`b`) and base rows (`w`), or None. The merged test is the bound |W| + |scale|·rank·max|B|·max|A| of every
    merged entry, no product formed: an accepted update never merges to inf, in either mode, and one refused by
    the bound but finite once merged would need entries within a factor `rank` of the dtype's range."""
    largest_finite = _max(dtype)
    if not _fits(abs(scale) * b, dtype):
        return (f"{name}.lora_B.weight × scale {scale:.4g} reaches {abs(scale) * b:.4g}, inf in "
                f"{_dtype_name(dtype)} (largest finite {largest_finite:.4g})")
    bound = w + abs(scale) * rank * a * b
    if not bound <= largest_finite * MERGE_MARGIN:
        return (f"{name}: the merged weight W + scale·B·A may reach {bound:.4g} (|W| + |scale|·rank·max|B|·"
                f"max|A|), beyond {_dtype_name(dtype)}'s largest finite {largest_finite:.4g}")
    return None
