"""One copy of the frozen base weights (`--share-base-weights`): an engine in the trainer's process reads the train
side's bf16 base tensors (the same storage) instead of loading a second copy from the checkpoint.

Safe only where nothing can change the base under the engine, or the engine under the train side (`decide`):
- the engine in this process (the `local` placement): another process cannot read this one's tensors;
- a LoRA run: a full fine-tune (`--no-use-lora`) updates every weight at every step;
- LoRA updates unmerged: a merged LoRA (`--lora-merge-mode merged`) is written into the engine's base weights;
- one rank: FSDP2 over R > 1 ranks leaves each rank 1/R of every weight (DTensor shards), and the full tensors exist
  only while a unit is gathered for its forward. (A tensor-parallel engine runs in processes of its own: the first
  rule.)
An EMA (`--ema-decay`) of a LoRA run averages the LoRA alone: the base stays frozen, so it shares. The KL reference
(`--kl-beta`) disables the adapters, not the base. The engine itself refuses what would write into a shared base
(a merged LoRA: `models.weight_map.set_lora`; a full-weight update: `engine.model_runner.ModelRunner.load_weights`).

`auto` (the default) shares where every rule holds, and says in one line why not where the engine runs in this
process but a rule fails; `true` refuses such a run in one line before anything loads; `false` never shares. The
engine says in one line what it shares and the tensors it still copies (`engine.engine.shared_base_line`: a packed
GEMM the patch group keeps, a cast)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..engine.interface import RolloutEngine
    from ..models.spec import ModelFamily
    from ..placement import EngineSpec, Placement
    from .config import TrainConfig

_PEFT_BASE = re.compile(r"\.base_layer(?=\.)")  # PEFT's wrapped layer: `to_q.base_layer.weight` is `to_q.weight`


def why_not(cfg: TrainConfig, world: int) -> str | None:
    """Why the engine cannot read the train side's base in this run (None: it can)."""
    if cfg.engine_process or cfg.engine_url or cfg.ray:
        return "the engine runs in a process of its own"
    if not cfg.use_lora:
        return "a full fine-tune (--no-use-lora) updates the base at every step"
    if cfg.lora_merge_mode == "merged":
        return "--lora-merge-mode merged writes the LoRA into the engine's base weights"
    if world > 1:
        return f"FSDP2 over {world} ranks leaves each rank 1/{world} of every base weight"
    return None


def decide(cfg: TrainConfig, world: int) -> bool:
    """Whether this run's engine reads the train side's base (module docstring); `--share-base-weights true` where
    it cannot is refused (ValueError, one line)."""
    reason = why_not(cfg, world)
    if cfg.share_base_weights is True and reason is not None:
        raise ValueError(f"--share-base-weights: {reason}, so the engine cannot read the train side's base weights; "
                         f"drop the flag (auto shares wherever it can)")
    return cfg.share_base_weights is not False and reason is None


def note(cfg: TrainConfig, world: int) -> str | None:
    """The line `auto` says where the engine runs in this process but keeps a copy of its own (None: nothing to say)."""
    reason = why_not(cfg, world)
    if cfg.share_base_weights == "auto" and reason is not None and not (cfg.engine_process or cfg.engine_url
                                                                         or cfg.ray):
        return f"engine: loads its own copy of the base weights ({reason})"
    return None


def base_tensors(model: nn.Module, family: ModelFamily) -> dict[str, torch.Tensor]:
    """The frozen weights of one expert's policy under diffusers' names (PEFT's `base_layer` dropped), each the
    storage the train side holds: a one-rank FSDP2 parameter's local tensor is the whole weight. The persistent
    buffers a checkpoint holds (SD3.5's position table) count as weights; the LoRA masters (trainable) and what the
    engine drops (`EngineSide.drops`) are left out."""
    tensors = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
    tensors += [(f"{mod_name}.{name}" if mod_name else name, b) for mod_name, mod in model.named_modules()
                for name, b in mod.named_buffers(recurse=False) if name not in mod._non_persistent_buffers_set]
    out = {}
    for name, t in tensors:
        if family.engine.drops is not None and family.engine.drops(name):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.shape != t.shape:  # `decide` keeps sharded runs off this path
            raise ValueError(f"{name}: this rank holds a shard {tuple(local.shape)} of {tuple(t.shape)}, not the "
                             "whole weight the engine needs")
        out[_PEFT_BASE.sub("", name)] = local.detach()
    return out


@dataclass(frozen=True)
class EngineOnBase:
    """An in-process engine still to build on the train side's base (`Trainer` builds it once its models exist)."""

    spec: EngineSpec
    placement: Placement

    def build(self, models: Mapping[str, nn.Module], family: ModelFamily) -> RolloutEngine:
        from ..placement import build_engine

        return build_engine(self.spec, self.placement, base=[base_tensors(m, family) for m in models.values()])
