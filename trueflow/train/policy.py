"""The policy being trained: the model family's diffusers transformer + a PEFT LoRA, sharded with FSDP2 under the
precision contract (docs/precision.md): LoRA masters in fp32, bf16 compute copies made by FSDP2's mixed precision, the
frozen base stored as its bf16 compute copy (value-identical to casting fp32 masters each step, half the memory).
The model itself knows nothing of parallelism; `shard` applies FSDP2 to the built model.

A family of several experts (Wan2.2-A14B's `transformer` and `transformer_2`) has one such model per expert, held
as a mapping expert name -> model in the pipeline's order; the LoRA of every expert the settings train travels as
one state dict whose first-expert names are PEFT's own and whose other names are prefixed `"<expert>."`
(`models.spec.expert_prefix`), so a one-expert policy's names are exactly those of a plain PEFT model."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..models.spec import ModelFamily, expert_prefix
from .activations import checkpoint_blocks
from .model import LoraSpec, add_lora, load_transformer

if TYPE_CHECKING:
    from .model import DiffusersTransformer

M = TypeVar("M", bound=nn.Module)

_LORA_PARAM = re.compile(r"\.lora_[AB]\.default\.weight$")


def build_policy(family: ModelFamily, checkpoint: str, spec: LoraSpec | None, compute_dtype: torch.dtype,
                 device: torch.device, seed: int, gradient_checkpointing: bool = False,
                 subfolder: str = "transformer", checkpointed_blocks: int = 0) -> DiffusersTransformer:
    """The policy of one expert (`subfolder`, its pipeline component); `spec` None: frozen, without a LoRA (an
    expert the settings do not train). `gradient_checkpointing`: every block recomputes in the backward (diffusers');
    `checkpointed_blocks`: the first N do (`activations.checkpoint_blocks`)."""
    model = load_transformer(family, checkpoint, compute_dtype, subfolder)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    checkpoint_blocks(model, family.train.shard_units, checkpointed_blocks)
    if spec is not None:
        add_lora(model, spec, seed=seed)  # PEFT's init (B = 0), seeded
    for name, p in model.named_parameters():
        is_lora = bool(_LORA_PARAM.search(name))
        if is_lora:
            p.data = p.data.float()  # the fp32 master; FSDP2 casts it to the compute dtype for each forward
        p.requires_grad_(is_lora)
    return shard(model.to(device), compute_dtype, family.train.shard_units)


# FSDP2 warns that diffusers' output is a view (an in-place op on it would skip the pre-backward hook). The
# trainer never modifies model outputs in place, so the warning is noise in every step's log.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def shard(model: M, compute_dtype: torch.dtype, units: tuple[str, ...]) -> M:
    """FSDP2, one unit per item of each ModuleList named in `units` (the family's `train.shard_units`: its
    transformer blocks) and one for the rest (torchtitan's layout)."""
    # Forward inputs are left as the model passes them (`cast_forward_inputs=False`): a model that keeps some
    # tensors in fp32 on purpose (LTX-2.3's timestep and RoPE tables) must get them in fp32, as the plain compute-
    # dtype model the engine is compared with does; FSDP2's default would round them to the compute dtype.
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    kept = kept_in_fp32(model)
    for unit in units:
        for block in getattr(model, unit):
            fully_shard(block, mp_policy=mp, ignored_params=kept)
    fully_shard(model, mp_policy=mp, ignored_params=kept)
    return model


def kept_in_fp32(model: nn.Module) -> set[nn.Parameter]:
    """The frozen parameters diffusers keeps in fp32 whatever the load dtype (`_keep_in_fp32_modules`, matched as
    `from_pretrained` matches them: a component of the parameter's name; Wan2.2's time embedder, modulation tables and
    cross-attention norm). FSDP2 leaves them out of its mixed-precision cast (unsharded, as loaded), so the forward
    computes in fp32 where the pipeline does; the engine holds them in fp32 too. None for the other families."""
    names = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return {p for name, p in model.named_parameters()
            if names & set(name.split(".")) and p.dtype == torch.float32 and not p.requires_grad}


def lora_parameters(models: Mapping[str, nn.Module]) -> dict[str, nn.Parameter]:
    """LoRA masters of every expert's model by PEFT state-dict name (`transformer_blocks.0.attn.to_q.lora_A.weight`),
    prefixed `"<expert>."` for each expert after the first."""
    names = list(models)
    return {f"{expert_prefix(names, k)}{name.replace('.default', '')}": p
            for k, model in enumerate(models.values()) for name, p in model.named_parameters()
            if _LORA_PARAM.search(name)}


def optimizer_module(models: Mapping[str, nn.Module]) -> nn.Module:
    """The module whose parameter names key the optimizer's full state dict in a checkpoint: the one expert's
    model itself (its PEFT names, as before experts), or the experts under their names."""
    return next(iter(models.values())) if len(models) == 1 else nn.ModuleDict(dict(models))


@torch.no_grad()
def lora_full_state(models: Mapping[str, nn.Module], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Unsharded LoRA tensors (a collective: every rank calls it), named as `lora_parameters`. With `dtype` = the
    compute dtype these are exactly the compute copies the forward used — what the engine must receive."""
    return full_state(lora_parameters(models), dtype)


@torch.no_grad()
def full_state(params: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`lora_full_state` of masters given by name (live parameters or a kept copy of them, sharded as they are)."""
    out = {}
    for name, p in params.items():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        out[name] = full.to(dtype) if dtype is not None else full.clone()
    return out


@torch.no_grad()
def set_lora_state(params: Mapping[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Copy unsharded tensors (a checkpoint's) into `params` (masters or EMA copies), sharded as each one is."""
    for name, p in params.items():
        value = full[name].to(p.device)
        if hasattr(p, "full_tensor"):
            from torch.distributed.tensor import DTensor, distribute_tensor

            d = cast(DTensor, p)  # it has `full_tensor`: a DTensor (FSDP2's sharded parameter)
            value = distribute_tensor(value, d.device_mesh, d.placements)
        p.copy_(value)
