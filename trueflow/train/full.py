"""Full-parameter training (`--no-use-lora`): every weight of every trained expert is an fp32 master, FSDP2-sharded
with the precision contract of docs/precision.md (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: each
forward runs on bf16 compute copies all-gathered from the masters' shards, gradients reduce in fp32 onto the
shards), the optimizer state sharded with them (it follows the DTensor parameters).

The weights the train forward cannot reach are frozen: the family's engine `drops` (LTX-2.3's audio stream and
cross-modal attentions, which the isolated video prediction never reads: tests/test_ltx2_pipeline.py) get no
gradient, no optimizer state, and are not sent to the engine, which holds none of them. An expert the settings do
not train (`--lora-experts`) is frozen whole, as in a LoRA run.

After each optimizer step the engines get the gathered bf16 compute copies (`compute_state`): each master's shard
cast to the compute dtype, then all-gathered (half the bytes of gathering fp32), under diffusers' names, as an
`OwnedWeights` an in-process engine may keep without a copy (`models.weight_map.load_weights`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..models.spec import ModelFamily, expert_prefix
from ..models.weight_map import OwnedWeights
from ..sync.full_weights import weights_checksum
from .activations import checkpoint_blocks
from .model import load_transformer

if TYPE_CHECKING:
    from .model import DiffusersTransformer
from .policy import shard
from .schedule import WeightsEMA


def build_full_policy(family: ModelFamily, checkpoint: str, trained: bool, compute_dtype: torch.dtype,
                      device: torch.device, gradient_checkpointing: bool = False,
                      subfolder: str = "transformer", checkpointed_blocks: int = 0) -> DiffusersTransformer:
    """One expert's model with fp32 masters of every weight, sharded (`policy.shard`); `trained` False: frozen.
    Checkpointing as `policy.build_policy`'s."""
    model = load_transformer(family, checkpoint, torch.float32, subfolder)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    checkpoint_blocks(model, family.train.shard_units, checkpointed_blocks)
    for name, p in model.named_parameters():
        p.requires_grad_(trained and reaches_output(family, name))
    return shard(model.to(device), compute_dtype, family.train.shard_units)


def reaches_output(family: ModelFamily, name: str) -> bool:
    """Whether the train forward can read weight `name` (diffusers' name): all but the family engine's `drops`."""
    return family.engine.drops is None or not family.engine.drops(name)


def named_weights(models: Mapping[str, nn.Module]) -> dict[str, nn.Parameter]:
    """Every weight of every expert by diffusers' name, `expert_prefix`ed after the first expert."""
    names = list(models)
    return {f"{expert_prefix(names, k)}{name}": p for k, model in enumerate(models.values())
            for name, p in model.named_parameters()}


def full_parameters(models: Mapping[str, nn.Module]) -> dict[str, nn.Parameter]:
    """The trained masters (those with requires_grad), named as `named_weights`."""
    return {n: p for n, p in named_weights(models).items() if p.requires_grad}


@torch.no_grad()
def compute_state(models: Mapping[str, nn.Module], family: ModelFamily, dtype: torch.dtype,
                  ema: WeightsEMA | None = None) -> OwnedWeights:
    """The bf16 compute copies of every weight the engine holds (a collective: every rank takes part), each a new
    tensor (`copy=True`: with an fp32 compute dtype the cast alone would hand out the master itself); `ema`: its
    averages in place of the trained masters (the EMA's sample grid)."""
    out, names = OwnedWeights(), list(models)
    for k, model in enumerate(models.values()):
        for name, p in model.named_parameters():
            if reaches_output(family, name):
                key = expert_prefix(names, k) + name
                master = ema.sharded(key) if ema is not None and key in ema.shadow else p
                local = master.to(dtype, copy=True)  # cast the shard first: the gather then moves bf16
                out[key] = local.full_tensor() if hasattr(local, "full_tensor") else local
    return out


def state_checksum(state: Mapping[str, torch.Tensor]) -> str:
    """The trainer's side of a full-weight sync: what the engine's `weights_checksum` is once it holds `state`."""
    return weights_checksum(state)


class UpdateNorm:
    """‖θ_after − θ_before‖₂ of the trained masters over one optimizer step, from each rank's shards (no gather: a
    full-size fp32 copy would not fit beside the training state), summed over ranks in float64. The shards' sums
    add in rank order, so the last bits depend on the world size (a LoRA run's norm is of the gathered tensors)."""

    def __init__(self, params: Mapping[str, nn.Parameter]):
        self.params = params
        self.before = {n: _local(p).clone() for n, p in params.items()}

    def __call__(self) -> float:
        total = torch.zeros((), dtype=torch.float64, device=next(iter(self.params.values())).device)
        for n, p in self.params.items():
            total += ((_local(p) - self.before[n]).double() ** 2).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return math.sqrt(total.item())


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()
