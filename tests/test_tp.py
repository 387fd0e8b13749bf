"""Tensor-parallel rollouts on this CPU with 2 gloo processes (docs/tensor-parallel.md): the shard plan (each rank
holds 1/N of every sharded tensor, a shape that does not divide refused), LoRA under TP (every rank's share of the
delta, against the formula), each rank's LoRA slice confirmed by checksum, the TP gate (TP=2 within the
`--patch-group none` bound, its warning said once), and the TP-matched train side (bitwise, `torch.equal`, with the
rank-ordered sums counted per forward)."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import tp_workers
from trueflow.cli import main
from trueflow.models import get_family
from trueflow.parallel import engine as tp_engine
from trueflow.net import free_port
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


def test_the_matched_train_side_computes_diffusers_function(monkeypatch):
    """fp32: the matched model (N GEMMs per sharded layer, attention per head group) is diffusers' stock function up
    to summation order; a wrong slice or a dropped share would be off by the size of a whole term. bf16: it differs
    from stock in bits (else the matched test above would prove nothing)."""
    from trueflow.train import model as train_model

    heads_seen = []  # the head count of every attention kernel call
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        heads_seen.append((args[0] if args else kwargs["query"]).shape[1])  # q [B, H, S, D]
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)

    config = FAMILY.presets.transformer_config("tiny")
    for dtype in (torch.float32, torch.bfloat16):
        stock = FAMILY.presets.build_transformer(config, seed=0, dtype=dtype)
        train_model.add_lora(stock, train_model.LoraSpec(8, FAMILY.train.lora_targets), b_init_std=0.05, seed=1)
        matched = copy.deepcopy(stock)
        assert len(match_tp(matched, PLAN, TP)) == 12 * config["num_layers"]
        i = FAMILY.probe_inputs(config, 2, 7, 64, dtype, 0, "cpu")
        backend = FAMILY.train.backend(dtype)
        with torch.no_grad():
            t = FAMILY.train.timestep(i["timestep"], dtype)
            outs = []
            for m in (stock, matched):
                heads_seen.clear()
                outs.append(train_model.train_forward(FAMILY, m, i["hidden_states"], t, i["grid"], i["cond"],
                                                      backend=backend))
            # The matched side attends over the engine's head groups: N calls per block, H/N heads each.
            assert heads_seen == [config["num_attention_heads"] // TP] * (TP * config["num_layers"]), heads_seen
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
    rc = main(["parity", "--checkpoint", str(tiny_checkpoint), "--tp", "2", "--resolution", "50"])
    err = capsys.readouterr().err  # refused inside rank 0, after the processes started: still one line
    assert rc == 2 and err.count("\n") == 1 and "--resolution 50: must be a positive multiple of 16" in err, err
    with pytest.raises(ValueError, match="must equal --tp"):
        run_tp_probe(ProbeSpec(checkpoint=str(tiny_checkpoint)), 2, train_tp_match=4)
    planless = dataclasses.replace(FAMILY, engine=dataclasses.replace(FAMILY.engine, tp_plan=None))
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        tp_engine.tp_plan(planless, 2)
    model = FAMILY.presets.build_transformer(FAMILY.presets.transformer_config("tiny"), seed=0)
    with pytest.raises(ValueError, match="--tp 3 does not divide"):
        match_tp(model, PLAN, 3)
    typo = dataclasses.replace(PLAN, row=PLAN.row + (r"transformer_blocks\.\d+\.attn\.to_outt",))
    with pytest.raises(ValueError, match="to_outt.*names no linear layer"):
        match_tp(model, typo, 2)
    match_tp(model, PLAN, 2)
    with pytest.raises(ValueError, match="already TP-matched"):
        match_tp(model, PLAN, 2)


# -- shards, LoRA shares and checksums in 2 processes ---------------------------------------------------------
def test_shards_lora_shares_and_checksums_in_two_processes():
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(tp_workers.shards_rank, args=(TP, free_port(), queue), nprocs=TP, join=True)
    reports = sorted((queue.get() for _ in range(TP)), key=lambda r: r["rank"])
    for r in reports:
        # Every rank's share of the LoRA delta counts: one missing would be off by `share` (checked much larger).
        # Unmerged to fp64 rounding; merged to the fp32 in which `Linear.set_lora` forms W + s·B·A.
        assert max(r["h_err_merged_False"], r["y_err_merged_False"]) < 1e-12, r
        assert max(r["h_err_merged_True"], r["y_err_merged_True"]) < 1e-4, r
        assert r["share"] > 1e-2, r
        assert r["wrong_shards"] == [], f"rank {r['rank']} holds wrong slices: {r['wrong_shards']}"
        assert r["fractions"] == [1 / TP], f"rank {r['rank']} holds fractions {r['fractions']} of sharded tensors"
        assert r["sharded_layers"] == 8 * FAMILY.presets.transformer_config("tiny")["num_layers"]  # 10 slots in 8
        assert r["checksum"] == r["expected"][r["rank"]], f"rank {r['rank']}'s LoRA read back differs from its slice"
    assert [r["row_bias_held"] for r in reports] == [True, False]  # the row-parallel bias is added once, by rank 0
    tampered = reports[0]["expected_tampered"]
    assert tampered[0] == reports[0]["expected"][0] and tampered[1] != reports[1]["expected"][1]


def test_the_sum_over_three_ranks_is_in_rank_order():
    """From 3 ranks the order of a sum matters: every rank's output is ((p0 + p1) + p2) of the parts written out
    here (each rank's GEMM on its columns, the bias in rank 0's, its LoRA share), in bf16."""
    tp = 3
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(tp_workers.row_sum_rank, args=(tp, free_port(), queue), nprocs=tp, join=True)
    outs = {r: torch.from_numpy(y).to(torch.bfloat16) for r, y in (queue.get() for _ in range(tp))}
    x, W, b, A, B, s = tp_workers.row_inputs(tp)
    n = W.shape[1] // tp
    parts = []
    for r in range(tp):
        c = slice(r * n, (r + 1) * n)
        x_r = x[..., c].contiguous()
        parts.append(F.linear(x_r, W[:, c].contiguous(), b if r == 0 else None)
                     + F.linear(F.linear(x_r, A[:, c].contiguous()), B) * s)
    want = (parts[0] + parts[1]) + parts[2]
    assert not torch.equal(want, (parts[2] + parts[1]) + parts[0])  # these inputs tell the orders apart
    for r in range(tp):
        assert torch.equal(outs[r], want), f"rank {r} differs from the rank-ordered sum by " \
                                           f"{(outs[r].float() - want.float()).abs().max().item()}"


def test_the_latency_bench_runs_both_groups(capsys):
    """The 2xH200 latency tool (`python -m trueflow.parallel.bench`), as a CPU smoke run: times are meaningless here."""
    from trueflow.parallel import bench

    report = bench.main(["--tp", "2", "--lora-rank", "4", "--text-len", "7", "--warmup", "0", "--repeats", "1"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
    for group in ("none", "qwen_image"):
        assert report[group]["tp1_ms"] > 0 and report[group]["tp2_ms"] > 0 and report[group]["speedup"] > 0
