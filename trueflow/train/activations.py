"""Selective activation checkpointing (`--gradient-checkpointing auto`): the first k transformer blocks recompute
their activations in the backward, the others keep them; `memory.auto_checkpointing` picks the fewest k that fit the
memory plan. Applied to a built model from outside, as torchtitan's `apply_ac` does, but on each chosen block's
`forward` rather than by a wrapper module: module names, state-dict keys, PEFT's layers and FSDP2's units are those
of the model as diffusers builds it. FSDP2's hooks run around the block's call, outside the recomputed region, as
around torchtitan's wrapper: the backward gathers the block's weights before its recompute reads them.

Why the first blocks: the backward runs the blocks in reverse, so by the time it recomputes block k the activations
of every later block are freed, and the recompute costs no more than the peak at the end of the forward
(`memory.activation_units`). The recompute runs the same ops on the same inputs (non-reentrant
`torch.utils.checkpoint`, the RNG state restored), so gradients are bitwise those without it
(tests/test_memory_savings.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def blocks_in_order(model: nn.Module, units: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """(name, block) of every transformer block, in forward order: the ModuleLists `units` names (the family's
    `train.shard_units`, which list them in the order the model runs them), each from its first block."""
    return [(f"{unit}.{i}", block) for unit in units for i, block in enumerate(getattr(model, unit))]


def checkpoint_blocks(model: nn.Module, units: tuple[str, ...], count: int) -> list[str]:
    """Recompute the first `count` blocks (`blocks_in_order`) in the backward; returns their names."""
    blocks = blocks_in_order(model, units)
    if not 0 <= count <= len(blocks):
        raise ValueError(f"cannot checkpoint {count} of the model's {len(blocks)} blocks")
    for _, block in blocks[:count]:
        block.forward = _recomputed(block.forward)  # type: ignore[method-assign]  # the instance's own forward
    return [name for name, _ in blocks[:count]]


def _recomputed(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # a no-grad forward (the KL reference, parity) saves nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
