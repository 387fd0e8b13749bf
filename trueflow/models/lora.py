"""The LoRA of a built engine model, for any family (the engine-side half of weight sync): install PEFT-format
tensors (merged into the weights or kept as adapters), and read back what the layers hold. Below the engine and
the tensor-parallel engine (`parallel.engine`), which both install LoRA through it."""

from __future__ import annotations

import warnings

import torch

from ..layers.linear import Linear
from .spec import EngineModel, ModelFamily

LORA_MERGE_MODES = ("unmerged", "merged")


def _family(model: EngineModel) -> ModelFamily:
    return model.family


def resolve_lora_merge(model: EngineModel, requested: str | None) -> bool:
    """Whether a LoRA update is merged into the weights. By default the engine merges (fast) unless its patch
    group keeps adapters unmerged; an explicit `merged` under such a group is honoured with a warning."""
    if requested is None:
        return model.lora_merge
    if requested not in LORA_MERGE_MODES:
        raise ValueError(f"unknown LoRA merge mode {requested!r}; choose one of {', '.join(LORA_MERGE_MODES)}")
    if requested == "merged" and not model.lora_merge:
        warnings.warn("LoRA merge requested under a parity patch group: W + scale·B·A in bf16 rounds differently "
                      "from PEFT's unmerged forward (~1e-2 in bf16), so the rollout is no longer bitwise equal to "
                      "the train side. Use --lora-merge-mode unmerged to keep parity.", stacklevel=2)
    return requested == "merged"


def update_lora(model: EngineModel, peft_state_dict: dict[str, torch.Tensor], scale: float,
                merge_mode: str | None = None, check_only: bool = False) -> None:
    """Replace the engine's LoRA with PEFT-format tensors; all-or-nothing: names, shapes and the values as the
    engine's dtype holds them, scale included, are checked first (the family's `set_lora`), and a bad update
    raises WeightLoadError (a ValueError) naming every problem, with the previous weights left in place.
    `check_only`: check and stop (the checks hold for both merge modes)."""
    engine = _family(model).engine
    lora = engine.parse_peft_state_dict(peft_state_dict)
    if check_only:
        engine.set_lora(model, lora, scale, merge=False, check_only=True)
    else:
        engine.set_lora(model, lora, scale, merge=resolve_lora_merge(model, merge_mode))


def lora_slots(model: EngineModel) -> list[tuple[str, Linear, int]]:
    """(diffusers module name, layer, slot) of every installed adapter, in module order."""
    name_of = _family(model).engine.diffusers_module_name
    return [(name_of(name, slot if mod.packed else None), mod, slot) for name, mod in model.named_modules()
            if isinstance(mod, Linear) for slot, a in enumerate(mod.adapters) if a is not None]


def lora_state(model: EngineModel) -> dict[str, torch.Tensor]:
    """The installed LoRA (merged or not) as PEFT-format tensors, under diffusers' module names: what a weight
    sync sent, read back from the engine's layers (the engine side of the sync checksum)."""
    out = {}
    for prefix, mod, slot in lora_slots(model):
        a = mod.adapters[slot]
        assert a is not None  # `lora_slots` names the installed adapters only
        out[f"{prefix}.lora_A.weight"], out[f"{prefix}.lora_B.weight"] = a.A, a.B
    return out
