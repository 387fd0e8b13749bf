"""`--train-kernels fused` (docs/training.md): the family's eager-exact fused kernels, as autograd Functions, installed
underneath each built train-side model (`TrainSide.fused_kernels`; Qwen-Image's: `models/qwen_image/train_kernels.py`).
The forward's bits are the stock model's on every device; only on CUDA with triton do fewer kernels run."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

from .. import kernels
from ..models.spec import ModelFamily


def use_fused_kernels(family: ModelFamily, models: Iterable[nn.Module], device: torch.device) -> None:
    """Install the family's train kernels on every model (before any TP matching); says once where they cannot run."""
    install = family.train.fused_kernels
    if install is None:  # the settings refuse it first (TrainConfig.combination_errors)
        raise ValueError(f"--train-kernels fused: the {family.name} family has no train kernels; use "
                         "--train-kernels stock")
    if device.type != "cuda" or not kernels.ENABLED:
        why = "triton is not installed or TRUEFLOW_TRITON=0" if device.type == "cuda" else f"this is {device.type}"
        warnings.warn(f"--train-kernels fused: the eager-exact kernels run on CUDA with triton, and {why}: each "
                      "Function runs diffusers' own op sequence instead (the same bits, the analytic backward, no "
                      "fewer kernels)", stacklevel=2)
    for model in models:
        install(model)
