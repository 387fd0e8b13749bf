"""Tensor-parallel rollouts on this CPU with 2 gloo processes (docs/tensor-parallel.md): the shard plan (each rank
holds 1/N of every sharded tensor, a shape that does not divide refused), LoRA under TP (every rank's share of the
delta, against the formula), each rank's LoRA slice confirmed by checksum, the TP gate (TP=2 within the
`--patch-group none` bound, its warning said once), and the TP-matched train side (bitwise, `torch.equal`, with the
rank-ordered sums counted per forward)."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from trueflow.cli import main
from trueflow.layers.linear import Linear, LoraAdapter
from trueflow.models import get_family
from trueflow.models.qwen_image.weights import NAMES
from trueflow.models.weight_map import expected_tensors
from trueflow.parallel import engine as tp_engine
from trueflow.parallel.comm import free_port, init_tp
from trueflow.parallel.linear import sharded
from trueflow.parallel.plan import shard
from trueflow.parallel.train_match import match_tp
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.parity.tp import run_tp_probe

FAMILY = get_family("qwen_image")
PLAN = FAMILY.engine.tp_plan
TP = 2


def _parity(capsys, checkpoint, *extra: str) -> tuple[dict, str]:
    rc = main(["parity", "--checkpoint", str(checkpoint), "--patch-group", "qwen_image", "--tp", str(TP),
               "--lora-rank", "8", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out), err


# -- the gate and the matched train side (the acceptance commands) ----------------------------------------------
def test_tp2_without_the_match_is_within_the_none_bound_and_the_gate_says_so_once(tiny_checkpoint, capsys,
                                                                                   monkeypatch):
    monkeypatch.setattr(tp_engine, "_GATE_SAID", False)
    with pytest.warns(UserWarning, match=r"TP gate: --tp 2 .*--train-tp-match 2.*measured") as said:
        got, _ = _parity(capsys, tiny_checkpoint)
    # The bound: the stock engine (no group, TP=1) on the same inputs, measured by the existing probe.
    none = ParityProbe(ProbeSpec(checkpoint=str(tiny_checkpoint), lora_rank=8)).run("none")[0]
    diff = got["model_output_max_abs_diff"]
    assert not got["bitwise_equal"] and diff > 0, "TP=2 against stock diffusers should not be bitwise"
    assert diff <= none.model_output_max_abs_diff, f"TP=2 diff {diff} > --patch-group none's " \
                                                    f"{none.model_output_max_abs_diff}"
    assert f"{diff:.4g}" in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp_engine.tp_gate(TP, "qwen_image", diff, matched=False)  # once per process: no second warning


def test_tp2_with_the_matched_train_side_is_bitwise(tiny_checkpoint, capsys):
    got, err = _parity(capsys, tiny_checkpoint, "--train-tp-match", str(TP))
    assert got["bitwise_equal"] and got["model_output_max_abs_diff"] == 0.0, \
        f"matched TP=2 differs by {got['model_output_max_abs_diff']}, first at {got['first_differing_module']}"
    assert "TP gate" not in err
    # One rank-ordered sum per row-parallel layer: diffusers' to_out.0, to_add_out and the two FFNs' net.2, per block.
    layers = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())["num_layers"]
    assert got["collectives_per_forward"] == 4 * layers
    assert len(set(got["rank_lora_checksums"])) == TP  # each rank confirmed its own (different) slice


def test_the_matched_train_side_computes_diffusers_function():
    """fp32: the matched model (N GEMMs per sharded layer) is diffusers' stock function up to summation order; a
    wrong slice or a dropped share would be off by the size of a whole term. bf16: it differs from stock in bits
    (else the matched test above would prove nothing)."""
    from trueflow.train import model as train_model

    config = FAMILY.presets.transformer_config("tiny")
    for dtype in (torch.float32, torch.bfloat16):
        stock = FAMILY.presets.build_transformer(config, seed=0, dtype=dtype)
        train_model.add_lora(stock, train_model.LoraSpec(8, FAMILY.train.lora_targets), b_init_std=0.05, seed=1)
        matched = copy.deepcopy(stock)
        assert len(match_tp(matched, PLAN, TP)) == 12 * config["num_layers"]
        i = FAMILY.probe_inputs(config, 2, 7, 64, dtype, 0, "cpu")
        backend = FAMILY.train.backend(dtype)
        with torch.no_grad():
            outs = [train_model.train_forward(FAMILY, m, i["hidden_states"], FAMILY.train.timestep(i["timestep"], dtype),
                                              i["grid"], i["cond"], backend=backend) for m in (stock, matched)]
        if dtype == torch.float32:
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        else:
            assert not torch.equal(outs[1], outs[0]), "the matched bf16 forward should round differently from stock"


# -- refusals ------------------------------------------------------------------------------------------------------
def test_a_shard_that_does_not_divide_is_refused(tiny_checkpoint, capsys):
    rc = main(["parity", "--checkpoint", str(tiny_checkpoint), "--tp", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "--tp 3 does not divide the 2 attention heads" in err and "--tp among 1, 2" in err
    with pytest.raises(ValueError, match="must equal --tp"):
        run_tp_probe(ProbeSpec(checkpoint=str(tiny_checkpoint)), 2, train_tp_match=4)
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        tp_engine.tp_plan(get_family("ltx2"), 2)
    model = FAMILY.presets.build_transformer(FAMILY.presets.transformer_config("tiny"), seed=0)
    with pytest.raises(ValueError, match="--tp 3 does not divide"):
        match_tp(model, PLAN, 3)


# -- shards, LoRA shares and checksums in 2 processes ---------------------------------------------------------
def _full(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, cols, generator=g, dtype=torch.float64)


def _shards_rank(rank: int, tp: int, port: int, queue) -> None:
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
            col.set_lora([LoraAdapter(shard("column", "lora_A", A1, rank, tp), shard("column", "lora_B", B1, rank, tp),
                                      s)], merge=False)
            row.set_lora([LoraAdapter(shard("row", "lora_A", A2, rank, tp), shard("row", "lora_B", B2, rank, tp), s)],
                         merge=False)
            h = col(x)
            y = row(h)
        # The formula, unsharded: h = x W1ᵀ + b1 + s·(x A1ᵀ) B1ᵀ, y = h W2ᵀ + b2 + s·(h A2ᵀ) B2ᵀ.
        h_full = x @ W1.T + b1 + s * (x @ A1.T) @ B1.T
        y_full = h_full @ W2.T + b2 + s * (h_full @ A2.T) @ B2.T
        cols = slice(rank * 6, rank * 6 + 6)
        report["h_err"] = (h - h_full[..., cols]).abs().max().item()
        report["y_err"] = (y - y_full).abs().max().item()
        report["share"] = (s * (h_full[..., cols] @ A2[:, cols].T) @ B2.T).abs().max().item()  # this rank's delta

        # The tiny model, built sharded from full diffusers-named tensors.
        config = FAMILY.presets.transformer_config("tiny")
        full = FAMILY.engine.build_model(config, device="meta")
        gm = torch.Generator().manual_seed(1)
        state = {n: torch.randn((p[r] if r is not None else p).shape, generator=gm)
                 for n, (p, r) in sorted(expected_tensors(full, NAMES).items())}
        model = tp_engine.build_tp_engine_transformer(config, state, group, "cpu", torch.float32, family="qwen_image")
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


def test_shards_lora_shares_and_checksums_in_two_processes():
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_shards_rank, args=(TP, free_port(), queue), nprocs=TP, join=True)
    reports = sorted((queue.get() for _ in range(TP)), key=lambda r: r["rank"])
    for r in reports:
        # Every rank's share of the LoRA delta counts: one missing would be off by `share` (checked much larger).
        assert r["h_err"] < 1e-12 and r["y_err"] < 1e-12, r
        assert r["share"] > 1e-3, r
        assert r["wrong_shards"] == [], f"rank {r['rank']} holds wrong slices: {r['wrong_shards']}"
        assert r["fractions"] == [1 / TP], f"rank {r['rank']} holds fractions {r['fractions']} of sharded tensors"
        assert r["sharded_layers"] == 8 * FAMILY.presets.transformer_config("tiny")["num_layers"]  # 10 slots in 8
        assert r["checksum"] == r["expected"][r["rank"]], f"rank {r['rank']}'s LoRA read back differs from its slice"
    assert [r["row_bias_held"] for r in reports] == [True, False]  # the row-parallel bias is added once, by rank 0
    tampered = reports[0]["expected_tampered"]
    assert tampered[0] == reports[0]["expected"][0] and tampered[1] != reports[1]["expected"][1]
