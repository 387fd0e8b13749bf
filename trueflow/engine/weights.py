"""Building the engine's transformer, for any model family, and reading back or checking its full weights: the
family's engine side builds the model and maps diffusers' tensor names onto it. Its LoRA (the engine-side half of a
LoRA sync) is `models.lora`'s."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from .. import loading
from ..models import apply_patch_group, family_for_config, weight_map
from ..models.spec import EngineModel


def build_engine_transformer(
    config: dict,
    state_dict: dict[str, torch.Tensor],
    device="cpu",
    dtype: torch.dtype = torch.bfloat16,
    patch_group: str = "none",
    disabled_patches: tuple[str, ...] | list[str] = (),
    family: str | None = None,
) -> EngineModel:
    """The engine model of a diffusers transformer config (its family from the config's `_class_name`, or
    `family`), loaded with diffusers-named tensors, with a patch group applied."""
    fam = family_for_config(config, family)
    model = fam.engine.build_model(config, device=device, dtype=dtype)
    fam.engine.load_weights(model, state_dict)
    apply_patch_group(model, patch_group, disabled_patches)
    model.family = fam  # what its LoRA updates and read-backs map names with
    return model


def load_engine_transformer(checkpoint: str | Path, device="cpu", dtype: torch.dtype = torch.bfloat16,
                            patch_group: str = "none", disabled_patches=(), family: str | None = None,
                            subfolder: str = "transformer") -> EngineModel:
    """The engine model of the checkpoint's transformer `subfolder` (an expert's pipeline component)."""
    config = loading.read_transformer_config(checkpoint, subfolder)
    drops = family_for_config(config, family).engine.drops  # left unread: LTX-2.3's audio stream
    return build_engine_transformer(config, loading.read_transformer_state_dict(checkpoint, drops, subfolder),
                                    device, dtype, patch_group, disabled_patches, family)


def share_engine_transformer(checkpoint: str | Path, base: Mapping[str, torch.Tensor], device="cpu",
                             dtype: torch.dtype = torch.bfloat16, patch_group: str = "none",
                             disabled_patches: tuple[str, ...] | list[str] = (), family: str | None = None,
                             subfolder: str = "transformer") -> tuple[EngineModel, dict[str, str]]:
    """The engine model of the checkpoint's transformer `subfolder` on another model's tensors (diffusers names: the
    train side's frozen base, `train.shared_base`) instead of the checkpoint's: built on the meta device, the patch
    group applied (it decides which packed layers run one GEMM per split), then `weight_map.share_weights`. Returns
    the model (marked `shared_base`: the runner refuses full-weight updates, which would write into the base) and
    the tensors it had to copy (name -> why)."""
    config = loading.read_transformer_config(checkpoint, subfolder)
    fam = family_for_config(config, family)
    model = fam.engine.build_model(config, device="meta", dtype=dtype)
    apply_patch_group(model, patch_group, disabled_patches)
    drops = fam.engine.drops
    kept = weight_map.subset(dict(base), lambda k: drops is None or not drops(k))
    resolved = torch.empty(0, device=device).device  # "cuda" -> "cuda:0": what the train side's tensors report
    own = weight_map.share_weights(model, kept, weight_map.Names(fam.engine.map_module_name,
                                                                 fam.engine.diffusers_module_name), resolved)
    model.family = fam
    model.shared_base = True
    return model, own


def full_state(model: EngineModel) -> dict[str, torch.Tensor]:
    """Every weight of the engine model under diffusers' tensor names, read back from its parameters (views, no
    copy): what a full-weight update installed."""
    fam = model.family.engine
    return weight_map.full_state(model, weight_map.Names(fam.map_module_name, fam.diffusers_module_name))


def check_full(model: EngineModel, state_dict: dict[str, torch.Tensor]) -> None:
    """The checks of a full-weight update of `model` (what the family's `load_weights` checks), nothing applied."""
    fam, drops = model.family.engine, model.family.engine.drops
    keep = (lambda k: not drops(k)) if drops is not None else (lambda k: True)
    weight_map.check_weights(model, weight_map.subset(state_dict, keep),
                             weight_map.Names(fam.map_module_name, fam.diffusers_module_name))
