"""The engine in this process: `engine.Engine`, built from an `EngineSpec`."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..dtypes import torch_dtype
from .spec import EngineSpec, Placement

if TYPE_CHECKING:
    import torch

    from ..engine.engine import Engine
    from ..parallel.comm import TPGroup


def build_local(spec: EngineSpec, device: str | None = None, tp: TPGroup | None = None,
                base: Sequence[Mapping[str, torch.Tensor]] | None = None) -> Engine:
    """`spec`'s engine in this process, on `device` (default: the spec's; a tensor-parallel rank passes its own GPU)
    and, with `tp`, as one rank of a tensor-parallel engine; with `base`, on the caller's base tensors
    (`engine.Engine`)."""
    from ..engine.engine import Engine

    return Engine(spec.checkpoint, spec.patch_group, spec.disabled_patches, device or spec.device,
                  torch_dtype(spec.dtype), spec.cuda_graphs, family=spec.family, tp=tp, progress=spec.progress,
                  base=base)


def local_engine(spec: EngineSpec, placement: Placement,
                 base: Sequence[Mapping[str, torch.Tensor]] | None = None) -> Engine:
    """The `local` placement. Its warnings (a parity condition the patch group breaks) are shown every time: a run
    that starts two engines says so twice."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        return build_local(spec, base=base)
