"""Rollout patch groups: named sets of patches that swap an engine model's fast numerics for train-exact ones.

One self-contained module per model family defines its group (`GROUP`); a group is applied to an engine model
right after it is built, and each of its patches can be switched off alone to see what it buys.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from torch import nn

# Group name -> the module that defines it as `GROUP`. "none" keeps the engine's fast paths.
_GROUP_MODULES = {"qwen_image": "trueflow.models.qwen_image.patches"}
GROUP_NAMES = ("none", *_GROUP_MODULES)


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str  # what the patch makes exact, in one line
    apply: Callable[[nn.Module], None]


@dataclass(frozen=True)
class PatchGroup:
    name: str
    patches: tuple[Patch, ...]

    @property
    def patch_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.patches)


def get_group(name: str) -> PatchGroup | None:
    """The group of that name, or None for "none". `family:backend` (e.g. `qwen_image:_native_cudnn`) is the family's
    group for a train side running that diffusers attention backend (the module's `make_group`)."""
    if name == "none":
        return None
    family, _, train_backend = name.partition(":")
    if family not in _GROUP_MODULES:
        raise ValueError(f"unknown patch group {name!r}; choose one of {', '.join(GROUP_NAMES)}")
    module = importlib.import_module(_GROUP_MODULES[family])
    return module.make_group(train_backend) if train_backend else module.GROUP


def apply_patch_group(model: nn.Module, name: str, disabled: tuple[str, ...] | list[str] = ()) -> list[str]:
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
