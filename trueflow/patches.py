"""Rollout patch groups: named sets of patches that swap an engine model's fast numerics for train-exact ones.

Each model family declares its groups (`ModelFamily.patch_groups`, trueflow/models/<family>/family.py); a group is
applied to an engine model right after it is built (`models.apply_patch_group`, where the registry finds the group),
and each of its patches can be switched off alone to see what it buys. This module is a leaf below models/.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Mapping

from torch import nn

def attention_kernel(kernels: Mapping[str, str], train_backend: str, condition: str = "") -> str:
    """The engine kernel whose forward is bitwise `train_backend`'s (a family's diffusers attention backend ->
    engine kernel map), or ValueError naming the backends that have one; `condition`: what else the pairing must
    reproduce, said in the error (" with LTX-2's text mask")."""
    if train_backend not in kernels:
        raise ValueError(f"no engine attention kernel reproduces the train backend {train_backend!r}{condition}; "
                         f"choose one of {', '.join(kernels)}")
    return kernels[train_backend]


def set_on(kinds: type | tuple[type, ...], attr: str, value) -> Callable[[nn.Module], None]:
    """A patch's `apply` that sets `attr = value` on every module of the given type(s) (how a patch switches a layer
    to its train-exact path)."""
    def apply(model: nn.Module) -> None:
        for m in model.modules():
            if isinstance(m, kinds):
                setattr(m, attr, value)
    return apply


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str  # what the patch makes exact, in one line
    apply: Callable[[nn.Module], object]  # its return value, if any, is unused


@dataclass(frozen=True)
class PatchGroup:
    name: str
    patches: tuple[Patch, ...]

    @property
    def patch_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.patches)


def _batch_invariant(model: nn.Module) -> None:
    """The batch-invariant mode (docs/patch-group.md): this process's GEMMs on the batch-invariant kernels
    (`kernels.batch_invariant.enable`, process-wide: the engine's process is where it runs), every attention call of
    the model on the `batch_invariant` kernel, and the model marked, so its runner may batch what the mode makes
    batch-invariant (the CFG branches, several prompts' microgroups)."""
    from .kernels import batch_invariant
    from .layers.attention import set_kernel

    batch_invariant.enable()
    set_kernel(model, batch_invariant.KERNEL)
    model.batch_invariant = True  # type: ignore[assignment]  # torch's stub: Module.__setattr__ takes only Tensor | Module


BATCH_INVARIANT_PATCH = Patch("batch_invariant", "batch-invariant GEMMs and per-sample attention over each sample's "
                                                 "own keys (the train side's trueflow_batch_invariant backend)",
                              _batch_invariant)
