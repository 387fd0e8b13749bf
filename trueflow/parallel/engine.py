"""A family's shard plan applied to a built engine model (torchtitan-style: the model code is unchanged; its planned
`Linear` layers are swapped for sharded ones, its gathered modules get input/output hooks), weights and LoRA loaded
sharded from the same diffusers names, and each rank's LoRA update confirmed by checksum.

A rank's attention holds whole heads: H/N of them, in its q/k/v projections' rows. Where the attention unflattens
q/k/v by head dimension (Qwen-Image's) it needs nothing more; where it counts its heads (`heads`, LTX-2.3's) it is
told the rank's count. A module that computes across heads (LTX-2.3's q/k RMSNorm over all heads, its attention gate)
is a plan's gathered module: its inputs all-gathered, run whole, its output sliced back to the rank's heads.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..layers.linear import Linear
from ..models import apply_patch_group, family_for_config
from ..models.lora import lora_state, resolve_lora_merge
from ..models.spec import EngineModel, ModelFamily
from ..sync.checksum import tensors_checksum
from .comm import TPGroup, gather_cat
from .linear import replace_module, sharded
from ..models.tp_plan import COLUMN, TPPlan
from .plan import features_problem, shard_state_dict, shard_tensor


def tp_plan(family: ModelFamily, tp: int) -> TPPlan:
    """The family's plan; refused (one line) where the family declares none."""
    if family.engine.tp_plan is None:
        raise ValueError(f"the {family.name} family declares no tensor-parallel plan: run it without --tp "
                         f"{tp} (and without --train-tp-match)")
    return family.engine.tp_plan


def apply_tp(model: nn.Module, family: ModelFamily, tp: TPGroup) -> list[str]:
    """Swap every planned `Linear` of a built engine model for its sharded layer, hook its gathered modules and give
    its split attentions their share of the heads. Checked first, applied only if every layer divides. Returns the
    swapped engine module names."""
    plan = tp_plan(family, tp.size)
    name_of = family.engine.diffusers_module_name
    swaps, problems, seen = [], [], []
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        names = [name_of(name, i if mod.packed else None) for i in range(len(mod.splits))]
        seen += names
        kinds = {plan.kind(n) for n in names}
        if kinds == {None}:
            continue
        if len(kinds) > 1:
            problems.append(f"{name}: the projections packed in it are planned differently ({sorted(map(str, kinds))})")
            continue
        kind = kinds.pop()
        assert kind is not None  # the kinds are one, and not {None}
        if problem := features_problem(name, kind, mod.in_features, mod.splits, tp.size):
            problems.append(problem)
        swaps.append((name, mod, kind))
    problems += [f"the {family.name} TP plan's pattern {p!r} names no linear layer" for p in plan.unmatched(seen)]
    modules = [name_of(name) for name, _ in model.named_modules()]
    problems += [f"the {family.name} TP plan's gathered pattern {p!r} names no module"
                 for p in plan.unmatched(modules, plan.gathered + plan.gathered_inputs)]
    if problems:
        raise ValueError("; ".join(problems))
    for name, mod, kind in swaps:
        replace_module(model, name, sharded(mod, kind, tp))
    for name, mod in ((name_of(n), m) for n, m in model.named_modules() if n):
        if plan.gathers(name):
            gather_heads(mod, tp)
        elif plan.gathers_inputs(name):
            gather_heads(mod, tp, keep_output=True)
        # An attention that counts its heads (to unflatten v, or for a per-head mask) holds the rank's H/N.
        if isinstance(getattr(mod, "heads", None), int) and plan.kind(f"{name}.to_q") == COLUMN:
            mod.heads //= tp.size
    return [name for name, _, _ in swaps]


def gather_heads(module: nn.Module, tp: TPGroup, keep_output: bool = False) -> None:
    """Run `module` on every rank's heads: its tensor inputs all-gathered along dim 2 in rank order (the heads of
    [B, S, H·D] or [B, S, H, ...]; other arguments, e.g. RoPE tables for all heads, pass as they are), the module
    whole, then its output's dim 2 cut to this rank's heads, contiguous as a rank's own tensor is (`keep_output`:
    the output left whole, a replicated tensor). The module then computes on exactly the values, shapes and
    layouts the train side's unsharded module does."""
    def gather(x):
        return gather_cat(x, tp, dim=2) if isinstance(x, torch.Tensor) else x

    def inputs(_mod, args, kwargs):
        return tuple(map(gather, args)), {k: gather(v) for k, v in kwargs.items()}

    def output(_mod, _args, out):
        return out.chunk(tp.size, dim=2)[tp.rank].contiguous()

    module.register_forward_pre_hook(inputs, with_kwargs=True)
    if not keep_output:
        module.register_forward_hook(output)


def build_tp_engine_transformer(config: dict, rank_state_dict: dict[str, torch.Tensor], tp: TPGroup, device="cpu",
                                dtype: torch.dtype = torch.bfloat16, patch_group: str = "none",
                                disabled_patches=(), family: str | None = None) -> EngineModel:
    """`engine.weights.build_engine_transformer` for rank `tp.rank` of `tp.size`: the model built, its planned layers
    swapped, the rank's slice of the diffusers-named tensors (`plan.shard_state_dict`, or `scatter_shards`) loaded
    all or nothing, the group applied."""
    fam = family_for_config(config, family)
    tp_plan(fam, tp.size).check(config, tp.size)
    model = fam.engine.build_model(config, device=device, dtype=dtype)
    model.tp_layers = apply_tp(model, fam, tp)
    fam.engine.load_weights(model, rank_state_dict)
    apply_patch_group(model, patch_group, disabled_patches)
    model.family, model.tp = fam, tp
    return model


def scatter_shards(plan: TPPlan, state_dict: dict[str, torch.Tensor] | None, tp: TPGroup, device: torch.device,
                   drops: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Rank 0 holds the full diffusers-named tensors (`state_dict`; None elsewhere) and sends each other rank its
    slice, one tensor at a time (device to device under NCCL), so no rank but 0 ever holds more than its 1/N.
    The tensors `drops` names (the family's: what the engine drops) go to no rank. Returns this rank's slice."""
    manifest: list[list[dict[str, tuple[tuple[int, ...], torch.dtype]]] | None] = [None]
    if tp.rank == 0:  # names, shapes and dtypes of every rank's slice, from meta tensors (no copies)
        assert state_dict is not None  # rank 0 holds the full tensors
        if drops is not None:
            state_dict = {n: t for n, t in state_dict.items() if not drops(n)}
        meta = {n: t.to("meta") for n, t in state_dict.items()}
        manifest = [[{n: (tuple(t.shape), t.dtype) for n, t in shard_state_dict(plan, meta, r, tp.size).items()}
                     for r in range(tp.size)]]
    dist.broadcast_object_list(manifest, src=0, device=device if device.type == "cuda" else None, group=tp.group)
    slices = manifest[0]
    assert slices is not None  # rank 0 broadcast it
    if tp.rank == 0:
        assert state_dict is not None
        for r in range(1, tp.size):
            for name in sorted(slices[r]):
                part = shard_tensor(plan, name, state_dict[name], r, tp.size)
                assert part is not None  # the manifest lists each rank's tensors
                dist.send(part.to(device).contiguous(), dst=r, group=tp.group)
        return shard_state_dict(plan, state_dict, 0, tp.size)
    out = {}
    for name in sorted(slices[tp.rank]):
        shape, dtype = slices[tp.rank][name]
        out[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out[name], src=0, group=tp.group)
    return out


def _lora_names(family: ModelFamily, peft_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT tensors under the names `models.lora.lora_state` reads them back with (`M.lora_A.weight`)."""
    return {f"{m}.lora_{ab}.weight": t for m, pair in family.engine.parse_peft_state_dict(peft_state_dict).items()
            for ab, t in zip("AB", pair)}


def update_lora_tp(model: EngineModel, peft_state_dict: dict[str, torch.Tensor], scale: float,
                   merge_mode: str | None = None) -> str:
    """Install this rank's slice of a full PEFT LoRA (each rank takes its own), all or nothing across the ranks:
    every rank checks its slice, the ranks exchange their verdicts, and each applies only if no rank refused (a
    value bound holds per slice, e.g. the merged weight's: one rank's slice may fail where another's passes). A
    refusal raises the same ValueError on every rank, naming the ranks. Returns the checksum of what the rank's
    layers hold, read back (compare with `lora_shard_checksums`)."""
    fam, tp = model.family, model.tp
    engine = fam.engine
    assert engine.tp_plan is not None  # a TP model was built from its family's plan
    problem: str | None = None
    args: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float, bool] | None = None
    try:
        part = shard_state_dict(engine.tp_plan, peft_state_dict, tp.rank, tp.size)
        args = (engine.parse_peft_state_dict(part), scale, resolve_lora_merge(model, merge_mode))
        engine.set_lora(model, *args, check_only=True)
    except ValueError as e:
        problem = str(e)
    verdicts: list[str | None] = [None] * tp.size
    dist.all_gather_object(verdicts, problem, group=tp.group)
    if any(verdicts):
        raise ValueError("; ".join(f"tp rank {r}: {v}" for r, v in enumerate(verdicts) if v))
    assert args is not None  # set where no rank refused
    engine.set_lora(model, *args)
    return tensors_checksum(lora_state(model))


def lora_shard_checksums(family: ModelFamily, peft_state_dict: dict[str, torch.Tensor], tp: int,
                         dtype: torch.dtype) -> list[str]:
    """The sender's side: per rank, the checksum of the slice that rank must hold, in the engine's dtype."""
    plan = family.engine.tp_plan
    assert plan is not None  # a TP engine's family has a plan (`tp_plan` refused the family otherwise)
    return [tensors_checksum({k: v.to(dtype) for k, v in _lora_names(
        family, shard_state_dict(plan, peft_state_dict, r, tp)).items()}) for r in range(tp)]


_GATE_SAID = False


def tp_gate(tp: int, patch_group: str, measured: float | None, matched: bool) -> None:
    """Say once per process, as a warning, that a TP > 1 rollout under a parity patch group is not bitwise equal to
    the stock train side, with the difference measured (None: not measured here)."""
    global _GATE_SAID
    if _GATE_SAID or tp == 1 or matched or patch_group == "none":
        return
    _GATE_SAID = True
    diff = f"measured model_output_max_abs_diff {measured:.4g}" if measured is not None else \
        "not measured here: run `trueflow parity --tp N` to measure it"
    warnings.warn(f"TP gate: --tp {tp} under --patch-group {patch_group}: the engine runs the TP-aware LoRA forward "
                  f"(row-parallel shares added before a rank-ordered sum), whose sums differ from the train side's "
                  f"unsharded GEMMs; bitwise parity needs --tp 1 or the TP-matched train side "
                  f"(--train-tp-match {tp}); {diff}", stacklevel=2)
