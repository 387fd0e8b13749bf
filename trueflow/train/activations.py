"""Selective activation checkpointing (`--gradient-checkpointing auto`): the first k transformer blocks recompute
their activations in the backward, the others keep them; `memory.auto_checkpointing` picks the fewest k that fit the
memory plan. Applied to a built model from outside, as torchtitan's `apply_ac` applies it, through diffusers' own
hook: `ModelMixin.enable_gradient_checkpointing(gradient_checkpointing_func)` (diffusers/models/modeling_utils.py)
makes the model's forward hand every block call to that function (the model's `_gradient_checkpointing_func`
branch of its block loop, the one `--gradient-checkpointing` takes for every block), and ours runs the chosen blocks
under `torch.utils.checkpoint` (non-reentrant) and the others as they are. Module names, state-dict keys, PEFT's
layers and FSDP2's units are those of the model as diffusers builds it; the checkpoint wraps the block's call, so
whatever forward the block has when it runs (`--train-kernels fused` swaps it after the policy is built) and its
FSDP2 hooks are what is recomputed, as under diffusers' full checkpointing.

Why the first blocks: the backward runs the blocks in reverse, so by the time it recomputes block k the activations
of every later block are freed, and the recompute costs no more than the peak at the end of the forward
(`memory.activation_units`). The recompute runs the same ops on the same inputs (the RNG state restored), so
gradients are bitwise those without it (tests/test_memory_savings.py)."""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


def blocks_in_order(model: nn.Module, units: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """(name, block) of every transformer block, in forward order: the ModuleLists `units` names (the family's
    `train.shard_units`, which list them in the order the model runs them), each from its first block."""
    return [(f"{unit}.{i}", block) for unit in units for i, block in enumerate(getattr(model, unit))]


def checkpoint_blocks(model: nn.Module, units: tuple[str, ...], count: int) -> list[str]:
    """Recompute the first `count` blocks (`blocks_in_order`) in the backward; returns their names. With `count` 0
    the model is left as it is."""
    blocks = blocks_in_order(model, units)
    if not 0 <= count <= len(blocks):
        raise ValueError(f"cannot checkpoint {count} of the model's {len(blocks)} blocks")
    if count:
        chosen = {id(block) for _, block in blocks[:count]}

        def selective(block: nn.Module, *args):
            # diffusers calls this only with gradients enabled, with the arguments its plain branch passes by name
            return checkpoint(block.__call__, *args, use_reentrant=False) if id(block) in chosen else block(*args)

        model.enable_gradient_checkpointing(selective)  # type: ignore[operator]  # diffusers' ModelMixin method
    return [name for name, _ in blocks[:count]]
