"""What the batch-invariant mode unlocks (docs/patch-group.md, "The batch-invariant mode"): each comparison bitwise in
the mode at the real model's widths (Qwen-Image and LTX-2.3 at one block, LoRA on), and its failure side: the same
comparison outside the mode (the stock kernels, the plain patch group) differs. Then the same settings end to end at
the tiny size: a train run at 0.0 with no parity warning, a rollout whose microgroups hold several prompts, and the
server merging two clients' rollouts into one forward per step.

The oracle is always the definition of invariance: the engine's rows for a sample against the train side's rows for
that sample run in another batch (another size, other samples, other text lengths, another timestep beside it).
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from tqdm import tqdm

from conftest import BF16, assert_bitwise, assert_differs, randn
from test_server import assert_same_rollout
from trueflow.collate import collate_cond
from trueflow.engine.batcher import ForwardBatcher
from trueflow.engine.engine import Engine
from trueflow.engine.guidance import guide
from trueflow.engine.interface import RolloutRequest
from trueflow.engine.model_runner import ModelRunner, _branch
from trueflow.engine.sampling_params import SamplingParams
from trueflow.http import serve_in_thread
from trueflow.kernels import batch_invariant as BI
from trueflow.models.spec import Expert
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.placement.http import remote_rollout
from trueflow.server import create_app
from trueflow.train.config import ParityConditionWarning, TrainConfig
from trueflow.train.metrics import read_metrics
from trueflow.train.model import train_forward
from trueflow.train.run import run_training

QWEN, LTX = f"qwen_image:{BI.BACKEND}", f"ltx:{BI.BACKEND}"
MASKED = "non-trivial text mask"  # the stock train side's warning when it falls back to a masked kernel


@pytest.fixture(scope="module")
def qwen():
    """One-block Qwen-Image (3072 wide, text 3584) with a rank-4 LoRA: the train side in the mode in micro-batches of 2
    against a batch of 8, the engine in the mode and under the plain group. 16-pixel images are one token, so the
    image stream's GEMMs have one row per sample."""
    probe = ParityProbe(ProbeSpec(random_size="one_block", batch=8, text_len=7, resolution=16, lora_rank=4,
                                  batch_invariant=True, train_micro_batch=2))
    return probe, {"mode": probe.build_engine(QWEN), "stock": probe.build_engine("qwen_image")}


def texts(lengths: list[int], seed: int, width: int = 3584) -> list[torch.Tensor]:
    """One prompt's embedding per length (a prompt's samples share it)."""
    return [randn((n, width), seed + i) for i, n in enumerate(lengths)]


def cond(family, prompts: list[torch.Tensor], pad_to: int | None = None) -> dict:
    """The batch's conditioning as both sides collate it (batch-local padding, a mask where lengths differ), or padded
    to a whole window."""
    c = collate_cond([{"encoder_hidden_states": e} for e in prompts], family.pipeline.text_streams)
    if pad_to is not None:
        from trueflow.train.batch import _pad_to

        c = _pad_to(c, family.pipeline.text_streams, pad_to)
    return c


def run_engine(engine, x, t, c) -> torch.Tensor:
    """x [B, tokens, 64]: a 1 x tokens token grid."""
    with torch.no_grad():
        return engine(hidden_states=x, timestep=t, grid=(1, x.shape[1]), **c)


def run_train(probe, x, t, c, mode: bool) -> torch.Tensor:
    with torch.no_grad():
        return train_forward(probe.family, probe.train, x, probe.family.train.timestep(t, BF16), (1, x.shape[1]), c,
                             backend=BI.BACKEND if mode else None)


def runner_of(engine, family) -> ModelRunner:
    return ModelRunner([(Expert("transformer"), engine)], family, torch.device("cpu"), BF16, cuda_graphs=False)


def stock(probe, engines, rows_engine, rows_train):
    """The failure side: the same two computations on the stock kernels and the plain group."""
    BI.disable()
    return rows_engine(engines["stock"], False), rows_train(False)


# -- Qwen-Image at one block -------------------------------------------------------------------------------------------
def test_train_micro_batch_2_against_rollout_microgroup_8(qwen, bi_mode):
    probe, engines = qwen
    result, _ = probe.compare_engine(engines["mode"], QWEN)
    assert result.bitwise_equal and result.first_differing_module is None, result.first_differing_module
    i = probe.inputs
    BI.disable()
    rollout = run_engine(engines["stock"], i["hidden_states"], i["timestep"], i["cond"])
    pairs = torch.cat([run_train(probe, i["hidden_states"][s:s + 2], i["timestep"][s:s + 2],
                                 {k: v[s:s + 2] for k, v in i["cond"].items() if v is not None}, False)
                       for s in range(0, 8, 2)])
    assert_differs(rollout, pairs, "stock: microgroup 8 vs micro-batches of 2")


def test_micro_batch_of_two_timesteps(qwen, bi_mode):
    """`micro_batch_size_tstep` 2: the engine ran a microgroup of 8 at step a and at step b; one train micro-batch holds
    two of its samples at both steps."""
    probe, engines = qwen
    (prompt,) = texts([7], 10)
    x_a, x_b = randn((8, 1, 64), 11), randn((8, 1, 64), 12)
    t_a, t_b = torch.full((8,), 911.0), torch.full((8,), 402.5)
    rows = [2, 5]
    mixed_x, mixed_t = torch.cat([x_a[rows], x_b[rows]]), torch.cat([t_a[rows], t_b[rows]])

    def rollout(engine, _mode):
        c = cond(probe.family, [prompt] * 8)
        return torch.cat([run_engine(engine, x_a, t_a, c)[rows], run_engine(engine, x_b, t_b, c)[rows]])

    def train(mode):
        return run_train(probe, mixed_x, mixed_t, cond(probe.family, [prompt] * 4), mode)

    assert_bitwise(train(True), rollout(engines["mode"], True), "2 samples x 2 steps vs two microgroups of 8")
    assert_differs(*stock(probe, engines, rollout, train), "stock")


def test_dp_stride_mixes_prompts_of_other_lengths(qwen, bi_mode):
    """DP split `stride` (and a whole-window pad, condition 3): the engine ran each prompt's microgroup alone (no
    mask); a train micro-batch interleaves the two prompts, padded with a mask."""
    probe, engines = qwen
    short, long = texts([7, 20], 20)
    x = randn((8, 1, 64), 21)  # samples 0-3 of the short prompt, 4-7 of the long one
    t = torch.full((8,), 700.0)
    order = [0, 4, 1, 5]

    def rollout(engine, _mode):
        out = torch.cat([run_engine(engine, x[:4], t[:4], cond(probe.family, [short] * 4)),
                         run_engine(engine, x[4:], t[4:], cond(probe.family, [long] * 4))])
        return out[order]

    def train(mode, pad_to=None):
        return run_train(probe, x[order], t[order], cond(probe.family, [short, long, short, long], pad_to), mode)

    engine_rows = rollout(engines["mode"], True)
    assert_bitwise(train(True), engine_rows, "stride micro-batch vs per-prompt microgroups")
    assert_bitwise(train(True, pad_to=64), engine_rows, "padded to a 64-token window")
    with pytest.warns(UserWarning, match=MASKED):
        assert_differs(*stock(probe, engines, rollout, train), "stock")


def test_prompts_of_other_lengths_in_one_microgroup(qwen, bi_mode):
    """A microgroup of two prompts (the engine pads with a mask); the train side runs each prompt's samples alone."""
    probe, engines = qwen
    short, long = texts([5, 16], 30)
    x, t = randn((4, 1, 64), 31), torch.full((4,), 500.0)

    def rollout(engine, _mode):
        return run_engine(engine, x, t, cond(probe.family, [short, short, long, long]))

    def train(mode):
        return torch.cat([run_train(probe, x[:2], t[:2], cond(probe.family, [short] * 2), mode),
                          run_train(probe, x[2:], t[2:], cond(probe.family, [long] * 2), mode)])

    assert_bitwise(rollout(engines["mode"], True), train(True), "mixed microgroup vs each prompt alone")
    with pytest.warns(UserWarning, match="flash kernel is pinned"):  # the stock engine's flash kernel takes no mask
        assert_differs(*stock(probe, engines, rollout, train), "stock")


def test_cfg_branches_in_one_forward(qwen, bi_mode):
    """The model runner's two CFG branches as one forward (a 7-token prompt and the 1-token negative, masked) are the
    two separate calls' bits, and the train side's two separate calls'."""
    probe, engines = qwen
    pos_text, neg_text = texts([7, 1], 40)
    x, t = randn((4, 4, 64), 41), torch.full((4,), 830.0)
    pos, neg = cond(probe.family, [pos_text] * 4), cond(probe.family, [neg_text] * 4)

    def branches(engine, mode):
        runner = runner_of(engine, probe.family)
        assert runner.batch_invariant == mode
        assert runner.guidance.branches == ("batched" if mode else "separate")  # Qwen-Image's own: separate
        # outside the mode too: what one forward of both branches would give there
        batched = replace(probe.family.guidance, branches="batched")
        calls = []

        def forward(**inputs):
            calls.append(inputs["hidden_states"].shape[0])
            return runner.forwards[0](**inputs)

        with torch.no_grad():
            out = guide(batched, _branch(forward, (1, x.shape[1]), {}), x, t, pos, neg, 4.0,
                        probe.family.pipeline.text_streams)
        assert calls == [8], calls  # one forward of both branches' rows
        return torch.cat([out.positive, out.negative])

    def separate(mode):
        return torch.cat([run_train(probe, x, t, pos, mode), run_train(probe, x, t, neg, mode)])

    batched = branches(engines["mode"], True)
    assert_bitwise(batched, separate(True), "one forward of both branches vs the train side's two")
    assert_bitwise(batched, torch.cat([run_engine(engines["mode"], x, t, c) for c in (pos, neg)]), "engine's two")
    with pytest.warns(UserWarning, match="flash kernel is pinned"):
        assert_differs(*stock(probe, engines, branches, separate), "stock")


def denoise(runner, prompt: torch.Tensor, seed: int, family) -> object:
    """One microgroup of 2 samples of a prompt through 2 guided steps, the first stochastic (Qwen-Image's schedule
    takes no single step)."""
    params = SamplingParams(steps=2, num_sde_steps=1, height=16, width=16)
    schedule = family.pipeline.schedule(dict(family.pipeline.scheduler_config), 2, 1, "cpu")
    gens = [torch.Generator().manual_seed(seed + k) for k in range(2)]
    with torch.no_grad():
        return runner.denoise(0, [0, 1], gens, ({"encoder_hidden_states": prompt},
                                                {"encoder_hidden_states": texts([1], 99)[0]}),
                              (1, 1), schedule, params, [0], False, tqdm(disable=True))


def merged(runner, batcher, prompts, family) -> list:
    """Each prompt's microgroup on a thread of its own, their forwards merged by `batcher` (the server's merge)."""
    out = [None] * len(prompts)

    def run(i):
        with batcher.participant():
            out[i] = denoise(runner, prompts[i], 100 + i, family)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    with batcher.participant():  # holds the turn until every rollout is in, so they start their steps together
        for th in threads:
            th.start()
        while batcher.members < len(prompts) + 1:
            threading.Event().wait(0.01)
    for th in threads:
        th.join()
    return out


def test_a_round_merges_only_calls_on_one_expert():
    """Rollouts of a two-expert family at steps of different experts: a round runs one forward per expert (each caller
    gets its own expert's output), and calls on one expert share a forward (rows in arrival order, cut back)."""
    seen = []

    def expert(k):
        def forward(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_mask=None):
            seen.append((k, hidden_states.shape[0]))
            return hidden_states * (k + 2) + timestep[:, None, None]
        return forward

    batcher = ForwardBatcher([expert(0), expert(1)], [expert(0), expert(1)],
                             {"encoder_hidden_states": "encoder_hidden_states_mask"})

    def round_of(plan):
        out, seen[:] = [None] * len(plan), []

        def run(i, k):
            with batcher.participant():
                out[i] = batcher(k, hidden_states=torch.full((1, 2, 3), float(i + 1)), timestep=torch.zeros(1),
                                 encoder_hidden_states=torch.ones(1, 4 + i, 5))

        threads = [threading.Thread(target=run, args=(i, k)) for i, k in enumerate(plan)]
        with batcher.participant():  # holds the turn until every caller is in, so they make one round
            for th in threads:
                th.start()
            while batcher.members < len(plan) + 1:
                threading.Event().wait(0.005)
        for th in threads:
            th.join()
        return [float(o.flatten()[0]) for o in out], sorted(seen)

    assert round_of([0, 1]) == ([2.0, 6.0], [(0, 1), (1, 1)])  # none merged across experts
    assert round_of([1, 0, 1]) == ([3.0, 4.0, 9.0], [(0, 1), (1, 2)])  # expert 1's two callers share one forward
    assert batcher.merged_forwards == 1


def test_rollouts_of_other_prompts_merged_into_one_forward(qwen, bi_mode):
    """The server's merge at real width: two rollouts of prompts of other lengths, each step's forwards merged into
    one batch, give each rollout the trajectory it has alone (latents, log-probs, guided outputs)."""
    probe, engines = qwen
    prompts = texts([6, 19], 50)

    def trajectories(engine, mode):
        runner = runner_of(engine, probe.family)
        alone = [denoise(runner, p, 100 + i, probe.family) for i, p in enumerate(prompts)]
        if mode:
            batcher = runner.merge_forwards()
        else:  # outside the mode the runner refuses to merge; the batcher itself shows what merging would give
            with pytest.raises(ValueError, match="needs the batch-invariant mode"):
                runner.merge_forwards()
            batcher = ForwardBatcher([engine], [engine], probe.family.pipeline.text_streams)
            runner.forwards = [partial(batcher, 0)]
        together = merged(runner, batcher, prompts, probe.family)
        assert batcher.merged_forwards == (2 if mode else 4)  # every step's (each branch's, outside the mode)
        return [torch.cat([mg.latents.flatten(), mg.log_probs.flatten(), mg.guided_outputs.flatten()])
                for mg in together], [torch.cat([mg.latents.flatten(), mg.log_probs.flatten(),
                                                 mg.guided_outputs.flatten()]) for mg in alone]

    for i, (got, want) in enumerate(zip(*trajectories(engines["mode"], True))):
        assert_bitwise(got, want, f"rollout {i} merged vs alone")
    BI.disable()
    with pytest.warns(UserWarning, match="flash kernel is pinned"):
        got, want = trajectories(engines["stock"], False)
    assert_differs(torch.cat(got), torch.cat(want), "stock: merged vs alone")


# -- LTX-2.3 at one block ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ltx():
    # the probe's own train forward is not compared here: run on the stock kernels (cheap), not the mode's tiles
    probe = ParityProbe(ProbeSpec(random_size="one_block", family="ltx2", batch=1, text_len=1, resolution=32))
    return probe, {"mode": probe.build_engine(LTX), "stock": probe.build_engine("ltx")}


def test_ltx2_microgroup_of_two_prompts_against_micro_batches_of_one(ltx, bi_mode):
    """LTX-2.3 needs nothing but the mode: a microgroup of two prompts of other lengths (text masks on the engine)
    against the train side one sample at a time (its all-ones mask, as the pipeline passes it)."""
    probe, engines = ltx
    c = probe.config
    i = probe.family.probe_inputs(c, 4, 7, 32, BF16, 0, "cpu")
    prompts = [{"encoder_hidden_states": randn((n, c["cross_attention_dim"]), 60 + n),
                "audio_encoder_hidden_states": randn((n, c["audio_cross_attention_dim"]), 70 + n)} for n in (7, 12)]
    samples = [prompts[0], prompts[0], prompts[1], prompts[1]]
    streams = probe.family.pipeline.text_streams
    ts = probe.family.train.timestep(i["timestep"], BF16)

    def rollout(engine, _mode):
        with torch.no_grad():
            return engine(hidden_states=i["hidden_states"], timestep=i["timestep"], grid=i["grid"],
                          **collate_cond(samples, streams))

    def train(mode):
        with torch.no_grad():
            return torch.cat([train_forward(probe.family, probe.train, i["hidden_states"][s:s + 1], ts[s:s + 1],
                                            i["grid"], collate_cond([samples[s]], streams),
                                            backend=BI.BACKEND if mode else None) for s in range(4)])

    assert_bitwise(rollout(engines["mode"], True), train(True), "LTX-2.3 mixed microgroup vs samples alone")
    assert_differs(*stock(probe, engines, rollout, train), "stock")


# -- FLUX.1, SD3.5 and Wan2.2 at one block -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_microgroup_against_micro_batches_of_one(family, bi_mode):
    """Each family's `one_block` preset at its real GEMM widths (FLUX.1: a double- and a single-stream block, T5's
    4096-wide text; SD3.5-Medium: a dual-attention joint block and the context pre-only last one; Wan2.2: one
    TI2V-5B block), LoRA on, needs nothing but the mode: the engine's microgroup of 4 against the train side one
    sample at a time, bitwise, layer by layer; the stock kernels under the plain group differ. (One text length,
    so no mask is involved.) SD3's processor hands `to_add_out` a slice of the joint output that is contiguous at
    batch 1 and strided above it, which the stock `F.linear` runs on two paths (`batch_invariant._linear`)."""
    probe = ParityProbe(ProbeSpec(random_size="one_block", family=family, batch=4, text_len=7, resolution=16,
                                  lora_rank=4, batch_invariant=True, train_micro_batch=1))
    result, _ = probe.run(f"{family}:{BI.BACKEND}")
    assert result.bitwise_equal and result.first_differing_module is None, result.first_differing_module
    BI.disable()
    probe.train_backend = probe.family.train.backend(BF16)
    probe.set_inputs(probe.inputs)  # the train side again, micro-batches of one on the stock kernels
    stock_result, _ = probe.run(family)
    assert not stock_result.bitwise_equal, "stock: microgroup 4 vs micro-batches of 1 did not differ"


def test_linear_takes_one_path_for_strided_and_contiguous_rows(bi_mode):
    """The stock `F.linear` adds a strided 3-D input's bias after the GEMM (two roundings) and a contiguous one's in
    its epilogue (one): the rows of a joint output's slice differ between batch 4 (strided) and batch 1
    (contiguous). In the mode they are one path, and it is the epilogue one (torch.addmm of the rows)."""
    x, w, b = randn((4, 24, 256), seed=1), randn((256, 256), seed=2, std=0.05), randn((256,), seed=3)
    strided = F.linear(x[:, 16:], w, b)
    alone = torch.cat([F.linear(x[i:i + 1, 16:], w, b) for i in range(4)])
    assert_bitwise(strided, alone, "mode: strided batch 4 vs contiguous batch 1")
    assert_bitwise(strided, torch.addmm(b, x[:, 16:].reshape(-1, 256), w.t()).view(4, 8, 256), "epilogue path")
    BI.disable()
    assert_differs(F.linear(x[:, 16:], w, b), torch.cat([F.linear(x[i:i + 1, 16:], w, b) for i in range(4)]),
                   "stock F.linear, strided vs contiguous")


# -- end to end at the tiny size ---------------------------------------------------------------------------------------
def test_train_run_in_the_mode_is_bitwise_with_no_parity_warning(tmp_path, tiny_checkpoint):
    """Every setting the mode lifts at once: two prompts of other lengths in one rollout microgroup of 4, train
    micro-batches of 2 samples x 2 steps, DP split `stride`, a whole-window pad; 0.0 and ratio 1 at every step."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na very long prompt about a red cube standing on a wooden table in the morning sun\n")
    settings = dict(output_dir=str(tmp_path / "run"), checkpoint=str(tiny_checkpoint), prompts=str(prompts), steps=3,
                    num_sde_steps=2, rollout_batch_size=2, n_samples_per_prompt=2, micro_batch_size_sample=2,
                    micro_batch_size_tstep=2, train_dp_split_mode="stride", pad_text_to=32, num_rollouts=2,
                    resolution=32, sample_every=0)
    outside = TrainConfig(**settings, rollout_microgroup_size=2)
    assert [w.split(":")[0] for w in outside.parity_warnings()] == ["condition 3", "condition 4", "condition 4"]
    cfg = TrainConfig(**settings, rollout_microgroup_size=4, batch_invariant=True)
    assert cfg.parity_warnings() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParityConditionWarning)
        warnings.filterwarnings("error", message=f".*{MASKED}")
        run_training(cfg)
    for row in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        assert row["model_output_max_abs_diff"] == 0.0 and row["log_prob_max_abs_diff"] == 0.0
        assert row["ratio_max_abs_dev_from_1"] == 0.0


PROMPTS = ["a cat", "a very long prompt about a red cube standing on a wooden table in the morning sun"]
PARAMS = SamplingParams(steps=2, num_sde_steps=1, height=32, width=32)


@pytest.fixture(scope="module")
def tiny_engine(tiny_checkpoint) -> Engine:
    return Engine(tiny_checkpoint, QWEN)


def test_a_microgroup_of_several_prompts(tiny_engine, bi_mode, monkeypatch):
    """A microgroup of both prompts (its text masked) gives every sample the trajectory of one-prompt microgroups;
    outside the mode such a microgroup is refused. (Every step stochastic: a microgroup draws one SDE window, so a
    window would follow the first prompt's.)"""
    engine = tiny_engine
    params = SamplingParams(steps=2, height=32, width=32)
    one = engine.rollout(RolloutRequest(PROMPTS, 2, params, 7))
    spanning = SamplingParams(**{**vars(params), "rollout_microgroup_size": 4})
    both = engine.rollout(RolloutRequest(PROMPTS, 2, spanning, 7))
    assert [len(mg.sample_indices) for mg in both.microgroups] == [4]
    assert both.microgroups[0].cond["encoder_hidden_states_mask"] is not None
    for key in ("latents", "log_probs", "guided_outputs"):
        assert_bitwise(getattr(both.microgroups[0], key), torch.cat([getattr(mg, key) for mg in one.microgroups], 1),
                       key)
    assert_bitwise(both.images, one.images, "images")
    monkeypatch.setattr(engine.runner, "batch_invariant", False)  # what the plain group's engine is
    with pytest.raises(ValueError, match="multiple of rollout_microgroup_size"):
        engine.rollout(RolloutRequest(PROMPTS, 2, both.params, 7))


def test_server_merges_two_clients_rollouts(tiny_engine, bi_mode):
    """`serve --batch-invariant`: two clients' rollouts of other prompts and seeds run at once with their forwards
    merged, and each answer is bitwise that request's rollout alone."""
    engine = tiny_engine
    requests = [RolloutRequest([PROMPTS[0]], 2, PARAMS, 3), RolloutRequest([PROMPTS[1]], 2, PARAMS, 4)]
    alone = [engine.rollout(r) for r in requests]
    app = create_app(engine)
    with serve_in_thread(app) as url:
        gate = threading.Event()  # holds the worker until both requests wait, so they start together
        held = app.state.worker.submit(lambda _stop: gate.wait(60))
        with ThreadPoolExecutor(2) as pool:
            answers = pool.map(lambda r: remote_rollout(url, r), requests)
            while app.state.worker.depth < 3:
                threading.Event().wait(0.01)
            gate.set()
            answers = list(answers)
        assert held.future.result() is True
        merged_forwards = engine.runner.batcher.merged_forwards
    assert merged_forwards > 0, "the two rollouts never shared a forward"
    for got, want in zip(answers, alone):
        assert_same_rollout(got, want)


def test_a_family_the_mode_is_not_tested_on_is_refused_in_one_line(monkeypatch):
    import trueflow.models as models

    assert set(models.BATCH_INVARIANT_FAMILIES) == set(models.families()), "every family is verified in the mode"
    assert models.batch_invariant_group("sd3") == f"sd3:{BI.BACKEND}"
    monkeypatch.setattr(models, "BATCH_INVARIANT_FAMILIES", ("qwen_image", "flux"))  # as for a new family
    with pytest.raises(ValueError, match=r"^--batch-invariant is not verified for sd3 \(tested: qwen_image, "
                                         r"flux\): drop --batch-invariant$"):
        models.batch_invariant_group("sd3")
