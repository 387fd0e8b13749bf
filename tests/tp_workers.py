"""The ranks of tests/test_tp.py's multi-process tests: each reports what it holds and computes, and the test
asserts in its own process (kept apart from the test module so that a spawned rank imports little)."""

from __future__ import annotations

import torch

from trueflow.layers.linear import Linear, LoraAdapter
from trueflow.models import get_family
from trueflow.models.qwen_image.weights import NAMES
from trueflow.models.weight_map import expected_tensors
from trueflow.parallel import engine as tp_engine
from trueflow.parallel.comm import init_tp
from trueflow.parallel.linear import sharded
from trueflow.parallel.plan import shard

FAMILY = get_family("qwen_image")
PLAN = FAMILY.engine.tp_plan


def _full(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, cols, generator=g, dtype=torch.float64)


def shards_rank(rank: int, tp: int, port: int, queue) -> None:
    """What one rank reports: the formula's errors for a column->row pair with LoRA, its model shards against the
    full tensors, and its LoRA checksum."""
    torch.set_num_threads(1)
    group = init_tp(rank, tp, port, torch.device("cpu"))
    try:
        report = {"rank": rank}
        # A column-parallel layer (8 -> 12) feeding a row-parallel one (12 -> 8), each with a LoRA, in fp64.
        g = torch.Generator().manual_seed(0)
        x, s = torch.randn(3, 5, 8, generator=g, dtype=torch.float64), 0.5
        W1, b1, A1, B1 = _full(12, 8, g), _full(1, 12, g)[0], _full(2, 8, g), _full(12, 2, g)
        W2, b2, A2, B2 = _full(8, 12, g), _full(1, 8, g)[0], _full(2, 12, g), _full(8, 2, g)
        col = sharded(Linear(8, 12).double(), "column", group)
        row = sharded(Linear(12, 8).double(), "row", group)
        with torch.no_grad():
            col.weight.copy_(shard("column", "weight", W1, rank, tp))
            col.bias.copy_(shard("column", "bias", b1, rank, tp))
            row.weight.copy_(shard("row", "weight", W2, rank, tp))
            if rank == 0:
                row.bias.copy_(shard("row", "bias", b2, rank, tp))
            report["row_bias_held"] = row.bias is not None
            outs = {}
            for merge in (False, True):  # unmerged (PEFT's order per shard), then merged into each shard
                col.set_lora([LoraAdapter(shard("column", "lora_A", A1, rank, tp),
                                          shard("column", "lora_B", B1, rank, tp), s)], merge=merge)
                row.set_lora([LoraAdapter(shard("row", "lora_A", A2, rank, tp), shard("row", "lora_B", B2, rank, tp),
                                          s)], merge=merge)
                outs[merge] = (col(x), row(col(x)))
        # The formula, unsharded: h = x W1ᵀ + b1 + s·(x A1ᵀ) B1ᵀ, y = h W2ᵀ + b2 + s·(h A2ᵀ) B2ᵀ.
        h_full = x @ W1.T + b1 + s * (x @ A1.T) @ B1.T
        y_full = h_full @ W2.T + b2 + s * (h_full @ A2.T) @ B2.T
        cols = slice(rank * 6, rank * 6 + 6)
        for merge, (h, y) in outs.items():
            report[f"h_err_merged_{merge}"] = (h - h_full[..., cols]).abs().max().item()
            report[f"y_err_merged_{merge}"] = (y - y_full).abs().max().item()
        report["share"] = (s * (h_full[..., cols] @ A2[:, cols].T) @ B2.T).abs().max().item()  # this rank's delta

        # The tiny model, built sharded from full diffusers-named tensors.
        config = FAMILY.presets.transformer_config("tiny")
        full = FAMILY.engine.build_model(config, device="meta")
        gm = torch.Generator().manual_seed(1)
        state = {n: torch.randn((p[r] if r is not None else p).shape, generator=gm)
                 for n, (p, r) in sorted(expected_tensors(full, NAMES).items())}
        # Rank 0 sends each other rank its slice.
        shards = tp_engine.scatter_shards(PLAN, state if rank == 0 else None, group, torch.device("cpu"))
        model = tp_engine.build_tp_engine_transformer(config, shards, group, "cpu", torch.float32, family="qwen_image")
        held = expected_tensors(model, NAMES)
        wrong, fractions = [], set()
        for name, t in state.items():
            module, _, kind = name.rpartition(".")
            plan_kind = PLAN.kind(module)
            if plan_kind is None:
                continue
            p, rows = held.get(name, (None, None))
            mine = None if p is None else (p[rows] if rows is not None else p)
            if plan_kind == "row" and kind == "bias":
                want = t if rank == 0 else None
            else:  # the formula: column by output rows, row by input columns
                want = t.chunk(tp, dim=0 if plan_kind == "column" else 1)[rank]
                fractions.add(mine.numel() / t.numel())
            if (mine is None) != (want is None) or (want is not None and not torch.equal(mine, want)):
                wrong.append(name)
        report["wrong_shards"], report["fractions"] = wrong, sorted(fractions)
        report["sharded_layers"] = len(model.tp_layers)

        # A PEFT LoRA on every planned layer: each rank takes its slice and reads it back as a checksum.
        lora = {}
        for name in sorted({n.rpartition(".")[0] for n in state if PLAN.kind(n.rpartition(".")[0])}):
            p, rows = expected_tensors(full, NAMES)[f"{name}.weight"]
            out_f, in_f = (p[rows] if rows is not None else p).shape
            lora[f"transformer.{name}.lora_A.weight"] = torch.randn(4, in_f, generator=gm)
            lora[f"transformer.{name}.lora_B.weight"] = torch.randn(out_f, 4, generator=gm)
        report["checksum"] = tp_engine.update_lora_tp(model, lora, 1.0, "unmerged")
        report["expected"] = tp_engine.lora_shard_checksums(FAMILY, lora, tp, torch.float32)
        tampered = dict(lora)
        key = next(k for k in lora if ".to_out.0.lora_A" in k)
        tampered[key] = lora[key].clone()
        tampered[key][0, -1] += 1  # an element of the last rank's columns only
        report["expected_tampered"] = tp_engine.lora_shard_checksums(FAMILY, tampered, tp, torch.float32)
        queue.put(report)
    finally:
        torch.distributed.destroy_process_group()


def row_sum_rank(rank: int, tp: int, port: int, queue) -> None:
    """A bf16 row-parallel layer with a LoRA over `tp` ranks: its output on this rank."""
    torch.set_num_threads(1)
    group = init_tp(rank, tp, port, torch.device("cpu"))
    try:
        x, W, b, A, B, s = row_inputs(tp)
        row = sharded(Linear(W.shape[1], W.shape[0]).to(torch.bfloat16), "row", group)
        with torch.no_grad():
            row.weight.copy_(shard("row", "weight", W, rank, tp))
            if rank == 0:
                row.bias.copy_(b)
            row.set_lora([LoraAdapter(shard("row", "lora_A", A, rank, tp), B, s)], merge=False)
            # A row-parallel layer reads its own input columns (what the column-parallel layer before it made).
            y = row(x.chunk(tp, dim=-1)[rank].contiguous())
        # bf16 -> fp32 is exact; a tensor would travel as a shared-memory handle that dies with the rank
        queue.put((rank, y.float().numpy()))
    finally:
        torch.distributed.destroy_process_group()


def row_inputs(tp: int):
    g = torch.Generator().manual_seed(3)
    inner = 32 * tp
    x, W, b = torch.randn(2, 16, inner, generator=g), torch.randn(48, inner, generator=g), torch.randn(48, generator=g)
    A, B = torch.randn(4, inner, generator=g), torch.randn(48, 4, generator=g)
    return (*(t.to(torch.bfloat16) for t in (x, W, b, A, B)), 0.5)
