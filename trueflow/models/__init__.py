"""Model families and the registry that finds them.

Each sub-package `trueflow/models/<family>/` with a `family.py` declaring `FAMILY` (a `spec.ModelFamily`) is one
family; generic code asks this registry for it by name, by checkpoint or by transformer config, and never imports
a family module itself.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
from pathlib import Path
from typing import cast

from ..patches import PatchGroup
from .spec import EngineModel, Expert, ModelFamily


@functools.cache
def families() -> dict[str, ModelFamily]:
    """Every family, by name, found by scanning this package's sub-packages."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        finder = cast("importlib.machinery.FileFinder", info.module_finder)  # iter_modules over a folder: a FileFinder
        if info.ispkg and (Path(finder.path) / info.name / "family.py").is_file():
            family = importlib.import_module(f"{__name__}.{info.name}.family").FAMILY
            if family.name != info.name:
                raise RuntimeError(f"{finder.path}/{info.name}/family.py declares the family "
                                   f"{family.name!r}, not {info.name!r}")
            found[family.name] = family
    defaults = [f.name for f in found.values() if f.default]
    if len(defaults) != 1:
        raise RuntimeError(f"exactly one model family must be the default, found {defaults}")
    return found


def get_family(name: str) -> ModelFamily:
    fams = families()
    if name not in fams:
        raise ValueError(f"unknown model family {name!r}; valid families: {', '.join(fams)}")
    return fams[name]


def default_family() -> ModelFamily:
    return next(f for f in families().values() if f.default)


def family_for_checkpoint(checkpoint: str | Path, family: str | None = None) -> ModelFamily:
    """The family of a pipeline folder, from its `model_index.json` `_class_name`; `family` names it where the
    folder has none (a bare transformer folder) and must agree where it has one. Neither: the default family. A family
    of several layouts (`ModelFamily.layout`) comes as the spec of this folder's."""
    index = Path(checkpoint) / "model_index.json"
    if not index.is_file():
        return get_family(family) if family is not None else default_family()
    model_index = json.loads(index.read_text())
    class_name = model_index.get("_class_name")
    match = [f for f in families().values() if f.pipeline_class == class_name]
    if not match:
        known = ", ".join(f"{f.pipeline_class} ({f.name})" for f in families().values())
        raise ValueError(f"{index}: no model family for the pipeline class {class_name!r}; known: {known}")
    if family is not None and family != match[0].name:
        raise ValueError(f"{checkpoint} is a {match[0].name} checkpoint ({class_name}), not {family}; "
                         f"drop --family or pass --family {match[0].name}")
    if match[0].layout is None:
        return match[0]

    def component_config(name: str) -> dict | None:
        path = Path(checkpoint) / name / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None

    try:
        return match[0].layout(model_index, component_config)
    except ValueError as e:
        raise ValueError(f"{checkpoint}: {e}") from None


def checkpoint_experts(checkpoint: str | Path, family: ModelFamily) -> tuple[Expert, ...]:
    """The transformers (experts) of a pipeline folder and the timesteps each serves: the family's `experts` of its
    model_index.json (the pipeline config; none for a bare transformer folder) and its scheduler config (the
    family's default where the folder has none). ValueError naming the folder if they are inconsistent."""
    root = Path(checkpoint)
    index, scheduler = root / "model_index.json", root / "scheduler" / "scheduler_config.json"
    model_index = json.loads(index.read_text()) if index.is_file() else {}
    config = json.loads(scheduler.read_text()) if scheduler.is_file() else dict(family.pipeline.scheduler_config)
    try:
        return family.experts(model_index, config)
    except ValueError as e:
        raise ValueError(f"{root}: {e}") from None


def family_for_config(config: dict, family: str | None = None) -> ModelFamily:
    """The family of a diffusers transformer config, from its `_class_name` (a preset dict has none: then
    `family`, or the default family)."""
    if family is not None:
        return get_family(family)
    class_name = config.get("_class_name")
    if class_name is None:
        return default_family()
    match = [f for f in families().values() if f.train.transformer_class == class_name]
    if not match:
        raise ValueError(f"no model family for the transformer class {class_name!r}; known: "
                         f"{', '.join(f.train.transformer_class for f in families().values())}")
    return match[0]


def family_for_patch_group(group: str) -> ModelFamily | None:
    """The family that declares patch group `group` (`name` or `name:backend`); None for "none"."""
    if group == "none":
        return None
    name = group.partition(":")[0]
    for f in families().values():
        if name in f.patch_groups:
            return f
    names = [g for f in families().values() for g in f.patch_groups]
    raise ValueError(f"unknown patch group {group!r}; choose one of {', '.join(['none', *names])}")


def parity_group(family: ModelFamily) -> str:
    """The patch group that makes `family`'s engine train-exact: the first it declares."""
    return next(iter(family.patch_groups))


def patch_group_for(family: ModelFamily, group: str | None, flag: str = "--patch-group") -> str:
    """The patch group an engine of `family` runs: `group`, or (None) the family's parity group; `none` keeps the
    engine's fast numerics. A group of another family is refused, naming the right one: its patches would set
    layers this family's engine does not have, or not all of the ones it has."""
    if group is None:
        return parity_group(family)
    owner = family_for_patch_group(group)  # raises on an unknown group, with the known names
    if owner is not None and owner.name != family.name:
        raise ValueError(f"{flag} {group} is the {owner.name} family's group, and this is a {family.name} "
                         f"checkpoint: use {flag} {parity_group(family)} (or none)")
    return group


# The families whose engine and train side the batch-invariant mode is tested on bitwise at real widths with a
# failure side (tests/test_batch_invariant_parity.py; Wan2.2 at the TI2V-5B's widths, not the A14B's 5120); a new
# family's `group:trueflow_batch_invariant` is refused until its test is added here.
BATCH_INVARIANT_FAMILIES = ("qwen_image", "ltx2", "flux", "sd3", "wan")


def batch_invariant_group(name: str) -> str:
    """The patch group of the batch-invariant mode for group `name` (`qwen_image` becomes
    `qwen_image:trueflow_batch_invariant`): what `--batch-invariant` makes of a verb's `--patch-group`. Refused in
    one line for `none` (the mode adds to a group's train-exact numerics) and for a group paired with another train
    backend."""
    from ..kernels.batch_invariant import BACKEND

    group, _, backend = name.partition(":")
    if group == "none":
        raise ValueError("--batch-invariant adds to a patch group's train-exact numerics: give --patch-group (e.g. "
                         "qwen_image), not none")
    if backend and backend != BACKEND:
        raise ValueError(f"--batch-invariant pairs the engine with the train side's {BACKEND} attention backend, "
                         f"not {backend}: use --patch-group {group}")
    get_group(f"{group}:{BACKEND}")  # an unknown group is refused with the known names
    return f"{group}:{BACKEND}"


def get_group(name: str) -> PatchGroup | None:
    """The group of that name, or None for "none" (which keeps the engine's fast paths). `group:backend` (e.g.
    `qwen_image:_native_cudnn`) is the group for a train side running that diffusers attention backend; for the
    batch-invariant backend (`group:trueflow_batch_invariant`), any family's group plus `BATCH_INVARIANT_PATCH`."""
    from ..kernels.batch_invariant import BACKEND
    from ..patches import BATCH_INVARIANT_PATCH

    family = family_for_patch_group(name)
    if family is None:
        return None
    group, _, train_backend = name.partition(":")
    spec = family.patch_groups[group]
    if train_backend == BACKEND:
        if family.name not in BATCH_INVARIANT_FAMILIES:
            raise ValueError(f"--batch-invariant is not verified for {family.name} (tested: "
                             f"{', '.join(BATCH_INVARIANT_FAMILIES)}): drop --batch-invariant")
        return PatchGroup(spec.group.name, (*spec.group.patches, BATCH_INVARIANT_PATCH))
    return spec.make(train_backend) if train_backend else spec.group


def apply_patch_group(model: EngineModel, name: str, disabled: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Apply group `name` to a built engine model, except the patches in `disabled`. Returns the applied names."""
    group = get_group(name)
    if group is None:
        if disabled:
            raise ValueError(f"--disable-patch {', '.join(disabled)} needs a patch group; "
                             f"--patch-group none applies no patches")
        model.patches_applied = []
        return []
    unknown = sorted(set(disabled) - set(group.patch_names))
    if unknown:
        raise ValueError(f"unknown patch(es) {', '.join(unknown)} for group {name!r}; "
                         f"its patches are: {', '.join(group.patch_names)}")
    applied = []
    for patch in group.patches:
        if patch.name not in disabled:
            patch.apply(model)
            applied.append(patch.name)
    model.patches_applied = applied
    return applied
