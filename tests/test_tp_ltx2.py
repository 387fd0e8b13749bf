"""LTX-2.3 under tensor parallelism on this CPU with 2 gloo processes (docs/tensor-parallel.md): the plan shards both
attentions (self- and text cross-attention) and the FFN, and runs what reads every head at once (the q/k RMSNorm
across heads, the attention gate) on the gathered heads. The acceptance commands (the TP gate within the
`--patch-group none` bound; bitwise with the matched train side, collectives counted), each rank holding 1/N of
every sharded tensor, the failing side (one row-parallel layer left unmatched), a TP-matched training run (0.0 at
every step), the matched train side's head groups with LTX's per-head text mask, and the refusals."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from trueflow.cli import main
from trueflow.models import get_family
from trueflow.parallel import engine as tp_engine
from trueflow.net import free_port
from trueflow.parallel.comm import TPGroup, init_tp
from trueflow.parallel.train_match import match_tp
from trueflow.parity.probe import ParityProbe, ProbeSpec

FAMILY = get_family("ltx2")
PLAN = FAMILY.engine.tp_plan
TP = 2
# Collectives per block: one rank-ordered sum per row-parallel layer (attn1.to_out.0, attn2.to_out.0, ff.net.2) and,
# per attention, one all-gather each for the q norm, the k norm and the gate's two inputs (its output, its logits).
PER_BLOCK = 3 + 2 * 4


def _parity(capsys, checkpoint, *extra: str) -> dict:
    rc = main(["parity", "--checkpoint", str(checkpoint), "--patch-group", "ltx", "--tp", str(TP), "--lora-rank", "8",
               "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _layers(checkpoint) -> int:
    return json.loads((checkpoint / "transformer" / "config.json").read_text())["num_layers"]


# -- the acceptance commands ---------------------------------------------------------------------------------------
def test_the_gate_is_within_the_none_bound_and_the_match_is_bitwise(ltx2_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(tp_engine, "_GATE_SAID", False)
    with pytest.warns(UserWarning, match=r"TP gate: --tp 2 under --patch-group ltx.*--train-tp-match 2.*measured"):
        gate = _parity(capsys, ltx2_checkpoint)
    # The bound: the stock engine (no group, TP 1) on the same inputs, measured by the single-process probe.
    none = ParityProbe(ProbeSpec(checkpoint=str(ltx2_checkpoint), lora_rank=8)).run("none")[0]
    diff = gate["model_output_max_abs_diff"]
    assert not gate["bitwise_equal"] and diff > 0, "TP 2 against stock diffusers should not be bitwise"
    assert diff <= none.model_output_max_abs_diff, f"TP 2 diff {diff} > none's {none.model_output_max_abs_diff}"

    matched = _parity(capsys, ltx2_checkpoint, "--train-tp-match", str(TP))
    assert matched["bitwise_equal"] and matched["model_output_max_abs_diff"] == 0.0, \
        f"matched TP 2 differs by {matched['model_output_max_abs_diff']}, first at {matched['first_differing_module']}"
    assert matched["collectives_per_forward"] == gate["collectives_per_forward"] == PER_BLOCK * _layers(ltx2_checkpoint)
    assert len(set(matched["rank_lora_checksums"])) == TP  # each rank confirmed its own (different) slice


# -- shards and the failing side, in 2 processes ---------------------------------------------------------------
def _rank(rank: int, tp: int, port: int, checkpoint: str, queue) -> None:
    """One engine rank built from its slice of the checkpoint; rank 0 also runs the train side three ways (stock,
    TP-matched, matched but for one row-parallel layer) and reports how each compares with the engine's output."""
    from conftest import engine_forward
    from trueflow.models.ltx2.weights import NAMES, is_audio_only
    from trueflow.models.weight_map import expected_tensors
    from trueflow.parallel.plan import shard_state_dict

    torch.set_num_threads(1)
    group = init_tp(rank, tp, port, torch.device("cpu"))
    try:
        probe = ParityProbe(ProbeSpec(checkpoint=checkpoint, lora_rank=8))  # seeded: the same on every rank
        engine = tp_engine.build_tp_engine_transformer(probe.config, shard_state_dict(PLAN, probe.state_dict, rank, tp),
                                                       group, "cpu", torch.bfloat16, "ltx", family="ltx2")
        tp_engine.update_lora_tp(engine, *probe.lora)
        report = {"rank": rank, "heads": sorted({m.heads for n, m in engine.named_modules()
                                                 if n.endswith(("attn1", "attn2"))})}
        held, wrong, fractions = expected_tensors(engine, NAMES), [], set()
        for name, t in probe.state_dict.items():
            module, _, kind = name.rpartition(".")
            plan_kind = PLAN.kind(module)
            if is_audio_only(name) or plan_kind is None:
                continue
            p, rows = held.get(name, (None, None))
            mine = None if p is None else p[rows] if rows is not None else p
            if plan_kind == "row" and kind == "bias":
                want = t if rank == 0 else None
            else:  # the formula: column by output rows, row by input columns
                want = t.chunk(tp, dim=0 if plan_kind == "column" else 1)[rank]
                fractions.add(mine.numel() / t.numel())
            if (mine is None) != (want is None) or (want is not None and not torch.equal(mine, want.to(mine.dtype))):
                wrong.append(name)
        report |= {"wrong": wrong, "fractions": sorted(fractions)}
        out = engine_forward(engine, probe.inputs)
        if rank == 0:
            one_left = dataclasses.replace(PLAN, row=(r"transformer_blocks\.\d+\.(attn1\.to_out\.0|ff\.net\.2)",
                                                      r"transformer_blocks\.[1-9]\d*\.attn2\.to_out\.0"))
            stock = probe.train
            for what, plan in (("stock", None), ("matched", PLAN), ("one_unmatched", one_left)):
                probe.train = copy.deepcopy(stock)
                if plan is not None:
                    match_tp(probe.train, plan, tp)
                probe.set_inputs(probe.inputs)
                report[what] = (torch.equal(out, probe.train_output),
                                (out.float() - probe.train_output.float()).abs().max().item())
        queue.put(report)
    finally:
        torch.distributed.destroy_process_group()


def test_each_rank_holds_its_slice_and_one_unmatched_layer_breaks_the_bits(ltx2_checkpoint):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(TP, free_port(), str(ltx2_checkpoint), queue), nprocs=TP, join=True)
    reports = sorted((queue.get() for _ in range(TP)), key=lambda r: r["rank"])
    heads = json.loads((ltx2_checkpoint / "transformer" / "config.json").read_text())["num_attention_heads"]
    for r in reports:
        assert r["wrong"] == [], f"rank {r['rank']} holds wrong slices: {r['wrong']}"
        assert r["fractions"] == [1 / TP], f"rank {r['rank']} holds fractions {r['fractions']} of sharded tensors"
        assert r["heads"] == [heads // TP]  # both attentions unflatten v into the rank's heads
    got = reports[0]
    assert got["matched"] == (True, 0.0), got
    assert not got["stock"][0] and got["stock"][1] > 0, got
    # The failing side: the same matched train side with one layer (block 0's text attention output projection)
    # left as one unsharded GEMM is no longer the engine's sum.
    assert not got["one_unmatched"][0] and got["one_unmatched"][1] > 0, got


def test_train_with_the_matched_train_side_is_bitwise(ltx2_checkpoint, tmp_path, monkeypatch):
    """`train --engine-process --tp 2 --train-tp-match 2` on LTX-2.3: the LoRA trains through the matched diffusers
    model and the sharded engine rolls out with each rank's slice, 0.0 at every step, no TP parity warning."""
    from trueflow.train.config import ParityConditionWarning, TrainConfig
    from trueflow.train.metrics import read_metrics
    from trueflow.train.run import run_training

    cfg = TrainConfig(output_dir=str(tmp_path / "run"), checkpoint=str(ltx2_checkpoint), num_frames=9, fps=12.0,
                      resolution=64, steps=3, num_sde_steps=1, cfg_scale=1.0, num_rollouts=2, rollout_batch_size=2,
                      n_samples_per_prompt=4, rollout_microgroup_size=4, micro_batch_size_sample=4, sample_every=0,
                      engine_process=True, tp=TP, train_tp_match=TP)
    monkeypatch.setattr(tp_engine, "_GATE_SAID", False)  # the engine client may say the gate: once, in this test
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParityConditionWarning)
        run_training(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["log_prob_max_abs_diff"] == 0.0, r
        assert r["lora_update_norm"] > 0 and r["checksums_equal"], r


# -- the matched train side in one process -------------------------------------------------------------------------
def test_the_matched_train_side_groups_heads_and_their_text_mask(monkeypatch):
    """fp32: the matched diffusers model (N GEMMs per sharded layer, attention per head group, each group with its
    rows of the per-head text bias) computes the stock function up to summation order; its kernels see H/N heads and
    an H/N-head mask. bf16: it rounds differently from stock (else the bitwise test above would prove nothing)."""
    from trueflow.train import model as train_model

    seen = []  # (q heads, mask heads) of every attention kernel call
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):  # diffusers' native backends pass keywords: query [B, H, S, D], attn_mask
        mask = kwargs.get("attn_mask")
        seen.append(((args[0] if args else kwargs["query"]).shape[1], None if mask is None else mask.shape[1]))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    config = FAMILY.presets.transformer_config("tiny")
    H, layers = config["num_attention_heads"], config["num_layers"]
    for dtype in (torch.float32, torch.bfloat16):
        stock = FAMILY.presets.build_transformer(config, seed=0, dtype=dtype)
        train_model.add_lora(stock, train_model.LoraSpec(8, FAMILY.train.lora_targets), b_init_std=0.05, seed=1)
        matched = copy.deepcopy(stock)
        # per block: q, k, v, gate logits and the output of both attentions, and the FFN's two layers
        assert len(match_tp(matched, PLAN, TP)) == (2 * 5 + 2) * layers
        i = FAMILY.probe_inputs(config, 2, 7, 64, dtype, 0, "cpu")
        outs = []
        with torch.no_grad():
            for m in (stock, matched):
                seen.clear()
                outs.append(train_model.train_forward(FAMILY, m, i["hidden_states"], FAMILY.train.timestep(
                    i["timestep"], dtype), i["grid"], i["cond"], backend=FAMILY.train.backend(dtype)))
        # Per block: the self-attention's N head groups unmasked, then the text attention's N groups, each with its
        # H/N rows of the per-head bias (the audio stream's attentions, not split, are left out by their H heads).
        video = [s for s in seen if s[0] != H]
        assert video == ([(H // TP, None)] * TP + [(H // TP, H // TP)] * TP) * layers, video
        if dtype == torch.float32:
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        else:
            assert not torch.equal(outs[1], outs[0]), "the matched bf16 forward should round differently from stock"


# -- refusals ------------------------------------------------------------------------------------------------------
def test_a_degree_or_plan_that_does_not_fit_is_refused(ltx2_checkpoint, capsys):
    rc = main(["parity", "--checkpoint", str(ltx2_checkpoint), "--patch-group", "ltx", "--tp", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "--tp 3 does not divide the 2 attention heads" in err and "--tp among 1, 2" in err
    config = FAMILY.presets.transformer_config("tiny")
    typo = dataclasses.replace(PLAN, gathered=PLAN.gathered + (r"transformer_blocks\.\d+\.attn1\.norm_qq",))
    family = dataclasses.replace(FAMILY, engine=dataclasses.replace(FAMILY.engine, tp_plan=typo))
    with pytest.raises(ValueError, match=re.escape("gathered pattern") + ".*norm_qq.*names no module"):
        tp_engine.apply_tp(FAMILY.engine.build_model(config, device="meta"), family, TPGroup(0, TP))
