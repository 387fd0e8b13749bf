"""The compute dtypes a user names (`--dtype bf16|fp32`) and the torch dtype of each: the one map every verb reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("bf16", "fp32")


def torch_dtype(name: str) -> torch.dtype:
    """`bf16` -> torch.bfloat16, `fp32` -> torch.float32 (torch is imported on call: the CLI names dtypes before it
    loads anything heavy)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The inverse: torch.bfloat16 -> `bf16`."""
    import torch

    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
