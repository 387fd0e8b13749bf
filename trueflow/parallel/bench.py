"""Forward latency of the engine at TP = N against TP = 1, in the same call, per patch group (fast: `none`, parity:
`qwen_image`), with a LoRA installed as each group installs it (merged / unmerged).

    python -m trueflow.parallel.bench --size full --tp 2 --device cuda --resolution 1024 --batch 1 --lora-rank 64

Each rank builds its own shard with seeded random weights (no train side, nothing scattered: only the time is
measured); rank 0 also builds the whole model for the TP = 1 rows. Eager forwards (no CUDA graphs); each timed
forward starts after a barrier on an idle device. Prints one JSON object: per group the median and min-max of both,
and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..dtypes import torch_dtype
from ..models.lora import update_lora
from ..models import apply_patch_group, get_family
from ..net import free_port
from .comm import init_tp
from .engine import apply_tp, tp_plan, update_lora_tp


def _random_(model: torch.nn.Module, seed: int) -> None:
    """Small seeded values in every parameter, drawn on its device (a rank's shard draws its own: the values do not
    matter here, only that they are finite)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)


def _lora(family, config: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT-format LoRA of `rank` on the family's targets (full tensors; each TP rank takes its slice)."""
    g = torch.Generator().manual_seed(seed)
    full = family.engine.build_model(config, device="meta")
    out = {}
    for name, mod in full.named_modules():
        for slot in range(len(getattr(mod, "splits", ()))):
            diffusers_name = family.engine.diffusers_module_name(name, slot if mod.packed else None)
            if diffusers_name.endswith(family.train.lora_targets):
                out[f"{diffusers_name}.lora_A.weight"] = torch.randn(rank, mod.in_features, generator=g) * 0.02
                out[f"{diffusers_name}.lora_B.weight"] = torch.randn(mod.splits[slot], rank, generator=g) * 0.02
    return out


def _time(forward, device: torch.device, warmup: int, repeats: int) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    return times


def _rank(rank: int, a: argparse.Namespace, port: int, queue) -> None:
    device = torch.device("cuda", rank) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = init_tp(rank, a.tp, port, device)
    try:
        family = get_family(a.family)
        config = family.presets.transformer_config(a.size)
        dtype = torch_dtype(a.dtype)
        inputs = family.probe_inputs(config, a.batch, a.text_len, a.resolution, dtype, a.seed, device)
        lora = _lora(family, config, a.lora_rank, a.seed) if a.lora_rank else None
        report = {}
        with torch.no_grad():
            for patch_group in a.patch_groups:
                def run(model):
                    return lambda: model(hidden_states=inputs["hidden_states"], timestep=inputs["timestep"],
                                         grid=inputs["grid"], **inputs["cond"])

                shard = family.engine.build_model(config, device=device, dtype=dtype)
                apply_tp(shard, family, group)
                _random_(shard, a.seed + rank)
                apply_patch_group(shard, patch_group)
                shard.family, shard.tp = family, group
                if lora is not None:
                    update_lora_tp(shard, lora, 1.0)
                tp_times = _time(run(shard), device, a.warmup, a.repeats)
                del shard
                one_times = None
                if rank == 0:  # TP = 1 on rank 0's device; the other ranks only wait at the barriers
                    whole = family.engine.build_model(config, device=device, dtype=dtype)
                    _random_(whole, a.seed)
                    apply_patch_group(whole, patch_group)
                    whole.family = family
                    if lora is not None:
                        update_lora(whole, lora, 1.0)
                    one_times = _time(run(whole), device, a.warmup, a.repeats)
                    del whole
                else:
                    for _ in range(a.warmup + a.repeats):
                        dist.barrier()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if rank == 0:
                    assert one_times is not None  # timed on rank 0 above
                    tp1, tpn = statistics.median(one_times), statistics.median(tp_times)
                    report[patch_group] = {"tp1_ms": tp1, "tp1_min_max": [min(one_times), max(one_times)],
                                           f"tp{a.tp}_ms": tpn, f"tp{a.tp}_min_max": [min(tp_times), max(tp_times)],
                                           "speedup": tp1 / tpn}
        if rank == 0:
            queue.put(report)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m trueflow.parallel.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen_image")
    p.add_argument("--size", default="tiny", help="a preset of the family (tiny, one_block, full)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--text-len", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--patch-groups", nargs="+", default=["none", "qwen_image"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    family = get_family(a.family)
    tp_plan(family, a.tp).check(family.presets.transformer_config(a.size), a.tp)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(a, free_port(), queue), nprocs=a.tp, join=True)
    report = {"settings": vars(a), **queue.get()}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
