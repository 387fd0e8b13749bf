"""The parity probe under tensor parallelism: the engine sharded over `tp` processes (gloo on the CPU, NCCL on CUDA,
on loopback), the train side in rank 0, stock diffusers or TP-matched (`train_tp_match`, `parallel.train_match`).

Rank 0 builds the probe (train side, LoRA, seeded inputs) and hands the other ranks what they need; each rank
builds its shard of the engine from the full diffusers-named tensors, takes its slice of the PEFT LoRA (checksum
confirmed against the slice the sender meant for it) and runs the forward; rank 0 compares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import loading
from ..models import apply_patch_group, family_for_checkpoint, get_family, family_for_config
from ..models.spec import ModelFamily
from ..net import free_port
from ..parallel.comm import init_tp
from ..parallel.engine import (build_tp_engine_transformer, lora_shard_checksums, scatter_shards, tp_gate, tp_plan,
                               update_lora_tp)
from ..parallel.train_match import match_tp
from .probe import ParityProbe, ProbeResult, ProbeSpec


@dataclass
class TPProbeResult(ProbeResult):
    tp: int = 1
    train_tp_match: int | None = None
    collectives_per_forward: int = 0  # rank-ordered sums and all-gathers one engine forward issued (rank 0's count)
    rank_lora_checksums: list[str] = field(default_factory=list)  # each rank's LoRA, read back, as confirmed


def _family_and_config(spec: ProbeSpec) -> tuple[ModelFamily, dict]:
    if spec.checkpoint is not None:
        return family_for_checkpoint(spec.checkpoint, spec.family), loading.read_transformer_config(spec.checkpoint)
    family = get_family(spec.family) if spec.family is not None else family_for_config({})
    assert spec.random_size is not None  # a probe spec names a checkpoint or a random size (`ProbeSpec`)
    return family, family.presets.transformer_config(spec.random_size)


def run_tp_probe(spec: ProbeSpec, tp: int, train_tp_match: int | None = None, patch_group: str = "none",
                 disabled: tuple[str, ...] = (), threads: int | None = None) -> TPProbeResult:
    """Compare the engine on `tp` ranks with the train side (TP-matched to `train_tp_match` ranks, or stock).
    Shapes and options are checked here, before any process starts; under a patch group without the match the TP
    gate's warning names the difference measured. `threads`: intra-op threads of every rank (the train side runs
    in rank 0 with the same count; default: this process's count split over the ranks)."""
    family, config = _family_and_config(spec)
    if train_tp_match is not None and train_tp_match != tp:
        raise ValueError(f"--train-tp-match {train_tp_match} must equal --tp {tp}: the train side computes each "
                         f"sharded layer as the engine's ranks do")
    tp_plan(family, tp).check(config, tp)
    apply_patch_group(family.engine.build_model(config, device="meta"), patch_group, disabled)  # names checked
    threads = threads or max(1, torch.get_num_threads() // tp)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(tp, free_port(), spec, patch_group, tuple(disabled), train_tp_match, threads, queue),
             nprocs=tp, join=True)
    result = queue.get()
    if isinstance(result, str):  # a rank refused its input: one line, as in a single process
        raise ValueError(result)
    tp_gate(tp, patch_group, result.model_output_max_abs_diff, matched=train_tp_match is not None)
    return result


def _rank(rank: int, tp: int, port: int, spec: ProbeSpec, patch_group: str, disabled: tuple[str, ...],
          train_tp_match: int | None, threads: int, queue) -> None:
    torch.set_num_threads(threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        spec = dataclasses.replace(spec, device=str(device))
    group = init_tp(rank, tp, port, device)
    try:
        _probe_rank(rank, tp, group, spec, patch_group, disabled, train_tp_match, device, queue)
    except ValueError as e:  # bad input: raised alike on every rank (rank 0's preparation is broadcast)
        if rank == 0:
            queue.put(str(e))
    finally:
        dist.destroy_process_group()


def _probe_rank(rank, tp, group, spec, patch_group, disabled, train_tp_match, device, queue) -> None:
    probe: ParityProbe | None = None
    payload: list[Any] = [None] * 5  # (refusal, family name, config, LoRA, inputs), pickled to every rank
    if rank == 0:
        try:
            probe = ParityProbe(spec)
            if train_tp_match is not None:
                assert probe.family.engine.tp_plan is not None  # `run_tp_probe` checked the family's plan
                match_tp(probe.train, probe.family.engine.tp_plan, train_tp_match)
                probe.set_inputs(probe.inputs)  # the train forward again, matched
            # Small objects travel pickled, on the CPU; the weights as each rank's slice (`scatter_shards`).
            payload = [None, probe.family.name, probe.config, None if probe.lora is None else (
                _cpu(probe.lora[0]), probe.lora[1]), _cpu(probe.inputs)]
        except ValueError as e:  # the other ranks wait for the payload: they get the refusal instead
            payload[0] = str(e)
    dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    refused, family_name, config, lora, inputs = payload
    if refused is not None:
        raise ValueError(refused)
    family = get_family(family_name)
    assert family.engine.tp_plan is not None  # as above
    shards = scatter_shards(family.engine.tp_plan, probe.state_dict if probe else None, group, device,
                            family.engine.drops)
    engine = build_tp_engine_transformer(config, shards, group, device, spec.torch_dtype(), patch_group,
                                         disabled, family=family_name)
    del shards
    checksum = update_lora_tp(engine, lora[0], lora[1], spec.lora_merge_mode) if lora is not None else ""
    checksums: list[str | None] = [None] * tp
    dist.all_gather_object(checksums, checksum)
    before = group.collectives
    if rank == 0:
        assert probe is not None  # rank 0's
        if lora is not None:
            expected = lora_shard_checksums(probe.family, lora[0], tp, spec.torch_dtype())
            bad = [r for r in range(tp) if checksums[r] != expected[r]]
            if bad:
                raise RuntimeError(f"LoRA shard checksum mismatch on rank(s) {bad}")
        result, _ = probe.compare_engine(engine, patch_group, disabled)
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(ProbeResult)}
        queue.put(TPProbeResult(**fields, tp=tp, train_tp_match=train_tp_match,
                                collectives_per_forward=group.collectives - before,
                                rank_lora_checksums=cast(list[str], checksums)))  # each rank's, gathered
    else:
        with torch.no_grad():
            inputs = _to(inputs, device)
            engine(hidden_states=inputs["hidden_states"], timestep=inputs["timestep"], grid=inputs["grid"],
                   **inputs["cond"])


def _cpu(obj):
    return _to(obj, torch.device("cpu"))


def _to(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj
