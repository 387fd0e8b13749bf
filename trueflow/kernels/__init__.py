"""GPU kernels for the engine's fast paths (Triton), chosen per call by the layers' fast `*_fused` functions.

A layer runs the Triton kernel when its input is on CUDA and triton is installed (`pip install trueflow[kernels]`;
GPU images ship it with torch), else the PyTorch fp32 fallback beside it in `trueflow.layers`; both compute in fp32
and round once per output. A patch group replaces the whole `impl`, so parity mode never runs these; some groups
run the eager-exact kernels of the same file instead (`use_eager_exact`). `TRUEFLOW_TRITON=0` (or
`kernels.ENABLED = False` before a forward) switches both off.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
ENABLED = HAS_TRITON and os.environ.get("TRUEFLOW_TRITON", "1") != "0"


def use_triton(x: torch.Tensor) -> bool:
    """Whether a fast op on `x` runs its Triton kernel (CUDA, and no autograd: the kernels have no backward)."""
    return ENABLED and x.is_cuda and not x.requires_grad


def ops() -> ModuleType:
    """The Triton kernels' launch functions (`triton_ops`), imported on first use so CPU runs never compile them."""
    return importlib.import_module(".triton_ops", __name__)


def use_eager_exact(*tensors: torch.Tensor) -> bool:
    """Whether a patch group's eager-exact kernels (`triton_ops.*_eager_bf16`) run on these tensors: Triton on CUDA
    (`use_triton` of the first) and bf16 throughout (the kernels round to bf16; any other dtype takes the family's
    reference)."""
    return use_triton(tensors[0]) and all(t.dtype == torch.bfloat16 for t in tensors)


def matching_variant(run: Callable[[bool], torch.Tensor], reference: torch.Tensor, warning: str) -> bool | None:
    """Which variant of an eager-exact kernel reproduces PyTorch's own op on a sample that tells them apart: True
    (the kernel fuses a product into its sum, as the device's PyTorch kernel may) before False (every product
    rounded); None where neither does, warned with `warning`, and the caller then runs its reference."""
    found = [fma for fma in (True, False) if torch.equal(run(fma), reference)]
    if not found:
        warnings.warn(warning, stacklevel=3)  # at the caller of the family's check
    return found[0] if found else None
