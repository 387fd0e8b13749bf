"""Full-parameter training (`--no-use-lora`) end to end on the tiny Qwen-Image and LTX-2.3 checkpoints: 0.0 at every
step on 1 and 2 FSDP ranks (torchrun, gloo on loopback), the engine in the trainer's process and in its own,
checksums equal, every weight that reaches the output moved; a SIGKILL inside a sharded (DCP) checkpoint write then
--resume gives the uninterrupted run's metrics and weights; a 2-rank checkpoint resumed on 1 rank; pruning and the
stated checkpoint size; the diffusers export loads with `from_pretrained` and gives the engine's output.

Cost: one in-process run per family, one torchrun whose two ranks run both families in turn (one process start
for both), one killed subprocess and two in-process resumes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trueflow.cli import main
from trueflow.models import get_family
from trueflow.net import free_port
from trueflow.train.config import TrainConfig
from trueflow.train.lock import LOCK_FILE
from trueflow.train.metrics import TIMING_KEYS, read_metrics
from trueflow.train.run import run_training

from conftest import TEST_THREADS

QWEN = dict(steps=3, num_sde_steps=1, rollout_batch_size=2, n_samples_per_prompt=4, rollout_microgroup_size=4,
            micro_batch_size_sample=4, sample_every=0, num_rollouts=2, save_every=1, use_lora=False)
# LTX-2.3 also with the lean optimizer and an offloaded EMA, so both run on FSDP2's DTensor shards.
LTX = dict(num_frames=9, fps=12.0, resolution=64, steps=4, num_sde_steps=1, cfg_scale=1.0, rollout_batch_size=2,
           n_samples_per_prompt=4, rollout_microgroup_size=4, micro_batch_size_sample=4, sample_every=0,
           num_rollouts=2, save_every=0, use_lora=False, optimizer="adamw_bf16", ema_decay=0.9, ema_offload=True)
# One rank: the engine in its own process (the full weights by shared-memory handles); 2 ranks: in each rank's.
# Sums over shards or micro-batches that another world size adds in another order (docs/training.md).
ORDER_DEPENDENT = ("grad_norm", "loss", "kl", "lora_update_norm")
# diffusers' QwenImageTransformer2DModel.forward passes only the image stream of its last block to norm_out/proj_out
# (transformer_qwenimage.py): that block's text-stream outputs feed nothing, so those weights get no gradient.
QWEN_NO_GRADIENT = re.compile(r"transformer_blocks\.1\.(attn\.(add_q_proj|norm_added_q|to_add_out)|txt_mlp)\.")
# LTX-2.3's audio stream and cross-modal attentions: the video prediction never reads them; frozen, kept as loaded.
LTX_FROZEN = re.compile(r"(^|\.)(audio_|av_cross_attn_|video_to_audio_attn|video_a2v_)")


def flags(**settings) -> list[str]:
    out = []
    for k, v in settings.items():
        flag = f"--{k.replace('_', '-')}"
        out += ([flag] if v else [f"--no-{flag[2:]}"]) if isinstance(v, bool) else [flag, str(v)]
    return out


def argv(checkpoint: Path, out: Path, settings: dict, *extra: str) -> list[str]:
    return ["train", "--checkpoint", str(checkpoint), "--output-dir", str(out), *flags(**settings), *extra]


def comparable(rows: list[dict], drop: tuple = ()) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and k not in drop} for r in rows]


def masters(ckpt: Path) -> dict[str, torch.Tensor]:
    """The fp32 masters a DCP checkpoint holds, gathered from every rank's shards."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "dcp", ckpt.parent / f"{ckpt.name}.pt")
    state = torch.load(ckpt.parent / f"{ckpt.name}.pt", weights_only=False)
    (ckpt.parent / f"{ckpt.name}.pt").unlink()
    return state["model"]


def assert_full_run(rows: list[dict], n: int) -> None:
    assert len(rows) == n
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["model_output_mean_abs_diff"] == 0.0, r
        assert r["log_prob_max_abs_diff"] == 0.0 and r["ratio_mean"] == 1.0, r
        assert r["checksums_equal"] and r["trainer_checksum"] == r["engine_checksum"], r
        assert r["lora_update_norm"] > 0 and r["time_sync"] > 0, r
    assert len({r["trainer_checksum"] for r in rows}) == n, "each sync carried new weights"


def assert_every_weight_moved(base: Path, ckpt: Path, fixed: re.Pattern) -> None:
    """Every master the train forward reaches changed over the run; those it cannot (`fixed`) are as loaded."""
    before = load_file(str(base / "transformer" / "diffusion_pytorch_model.safetensors"))
    after = masters(ckpt)
    assert set(after) == set(before)
    unchanged = {k for k in before if torch.equal(after[k], before[k].float())}
    assert unchanged == {k for k in before if fixed.search(k)} and unchanged != set(before)


# -- the runs ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_one(tiny_checkpoint, tmp_path_factory):
    """One rank, the engine in the trainer's process; the uninterrupted run the kill/resume test compares with."""
    out = tmp_path_factory.mktemp("fullft_qwen") / "run"
    run_training(TrainConfig(output_dir=str(out), checkpoint=str(tiny_checkpoint), keep_checkpoints=1,
                             threads=TEST_THREADS, **QWEN))
    return out, read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def ltx_one(ltx2_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("fullft_ltx") / "run"
    run_training(TrainConfig(output_dir=str(out), checkpoint=str(ltx2_checkpoint), **LTX))
    return out, read_metrics(out / "metrics.jsonl")


# Both families in one torchrun: each `trueflow train` ends its process group, so the second one meets on a store
# of its own (rank 0 hosts it on the second port) instead of torchrun's agent store.
# (Guarded: an engine process is spawned, and spawn imports the main script again.)
TWO_RUNS = """
import json, os, sys
from trueflow.cli import main
from trueflow.models import get_family
if __name__ == "__main__":
    for k, args in enumerate(json.loads(os.environ["FULLFT_RUNS"])):
        if k:
            os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            os.environ["MASTER_PORT"] = os.environ["FULLFT_PORT"]
        if main(args):
            sys.exit(1)
"""


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoint, ltx2_checkpoint, tmp_path_factory):
    """torchrun, 2 gloo ranks on loopback: Qwen-Image with an engine process per rank (the full weights by
    shared-memory handles), then LTX-2.3 with the engine in each rank's process."""
    tmp = tmp_path_factory.mktemp("fullft_two")
    script = tmp / "two_runs.py"
    script.write_text(TWO_RUNS)
    runs = [argv(tiny_checkpoint, tmp / "qwen", QWEN, "--engine-process"), argv(ltx2_checkpoint, tmp / "ltx", LTX)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "FULLFT_RUNS": json.dumps(runs),
           "FULLFT_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: (tmp / name, read_metrics(tmp / name / "metrics.jsonl")) for name in ("qwen", "ltx")}


# -- 1 and 2 ranks, two placements ------------------------------------------------------------------------------
def test_full_parameter_train_is_bitwise_on_one_and_two_ranks(qwen_one, ltx_one, two_ranks, tiny_checkpoint,
                                                              ltx2_checkpoint):
    for (out, rows), (out2, rows2), base, fixed in [(qwen_one, two_ranks["qwen"], tiny_checkpoint, QWEN_NO_GRADIENT),
                                                    (ltx_one, two_ranks["ltx"], ltx2_checkpoint, LTX_FROZEN)]:
        assert_full_run(rows, 2)
        assert_full_run(rows2, 2)
        # The same weights on 2 ranks as on 1 (one micro-batch per rank: the same gradient sum), in either placement.
        assert comparable(rows2, ORDER_DEPENDENT) == comparable(rows, ORDER_DEPENDENT)
        for r, r2 in zip(rows, rows2):
            for k in ORDER_DEPENDENT:
                assert r2[k] == pytest.approx(r[k], rel=1e-5, abs=1e-7), k
        for run in (out, out2):
            assert_every_weight_moved(base, run / "checkpoints" / "step-000002", fixed)


# -- checkpoints ------------------------------------------------------------------------------------------------
# Kills the run from inside its sharded write of checkpoint step 2: the DCP shards are on disk, its .metadata is not.
KILL_IN_DCP_WRITE = """
import os, signal, sys
from torch.distributed.checkpoint import filesystem
real_finish = filesystem.FileSystemWriter.finish
def finish(self, metadata, results):
    if '.tmp-step-000002' in str(self.path):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_finish(self, metadata, results)
filesystem.FileSystemWriter.finish = finish
from trueflow.cli import main
from trueflow.models import get_family
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_during_a_sharded_checkpoint_write_then_resume(qwen_one, tiny_checkpoint, tmp_path):
    ref_out, ref = qwen_one
    out = tmp_path / "run"
    settings = argv(tiny_checkpoint, out, {**QWEN, "keep_checkpoints": 1, "threads": TEST_THREADS})
    proc = subprocess.run([sys.executable, "-c", KILL_IN_DCP_WRITE, *settings], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert list((ckpts / ".tmp-step-000002" / "dcp").glob("*.distcp")), "killed with its shards written"
    assert not (ckpts / ".tmp-step-000002" / "dcp" / ".metadata").exists()
    assert (ckpts / "latest").read_text().strip() == "step-000001" and (out / LOCK_FILE).exists()
    assert main([*settings, "--resume"]) == 0
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(ref), "the uninterrupted run's metrics"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002"], "pruned to 1, the leftover gone"
    mine, theirs = masters(ckpts / "step-000002"), masters(ref_out / "checkpoints" / "step-000002")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    export = "transformer/diffusion_pytorch_model.safetensors"
    ref_ckpt = ref_out / "checkpoints" / "step-000002"
    assert (ckpts / "step-000002" / export).read_bytes() == (ref_ckpt / export).read_bytes()


def test_a_two_rank_checkpoint_resumes_on_one_rank(two_ranks, qwen_one, tmp_path):
    """DCP reshards the 2-rank step-1 checkpoint onto 1 rank; the trainer warns that the world size changed, and
    with one micro-batch per rank the continued run is the 2-rank run's bit for bit (weights, parity, rewards)."""
    src, rows2 = two_ranks["qwen"]
    out = tmp_path / "run"
    shutil.copytree(src, out)
    shutil.rmtree(out / "checkpoints" / "step-000002")
    (out / "checkpoints" / "latest").write_text("step-000001\n")
    saved = json.loads((out / "checkpoints" / "step-000001" / "trainer_state.json").read_text())
    assert saved["world_size"] == 2 and len(list((out / "checkpoints" / "step-000001" / "dcp").glob("*.distcp"))) == 2
    cfg = TrainConfig(**{**saved["config"], "resume": True, "output_dir": str(out), "engine_process": False})
    with pytest.warns(UserWarning, match=r"--resume on 1 rank\(s\) of a checkpoint 2 rank\(s\) wrote"):
        run_training(cfg)
    rows = read_metrics(out / "metrics.jsonl")
    assert comparable(rows, ORDER_DEPENDENT) == comparable(rows2, ORDER_DEPENDENT)
    assert rows[-1]["trainer_checksum"] == qwen_one[1][-1]["trainer_checksum"]


def test_checkpoints_are_pruned_and_their_size_is_stated(qwen_one):
    out, _ = qwen_one
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002"], "--keep-checkpoints 1"
    state = json.loads((ckpts / "step-000002" / "trainer_state.json").read_text())
    on_disk = {f: f.stat().st_size for f in (ckpts / "step-000002").rglob("*") if f.is_file()}
    assert state["size_bytes"] == sum(s for f, s in on_disk.items() if f.name not in ("trainer_state.json", "COMPLETE"))
    export = ckpts / "step-000002" / "transformer" / "diffusion_pytorch_model.safetensors"
    assert state["export_bytes"] == on_disk[export]


def test_the_export_loads_in_diffusers_and_gives_the_engines_output(qwen_one, tiny_checkpoint):
    """`from_pretrained` on the checkpoint's transformer/ gives the model whose forward equals the engine's holding
    the last sync (its checksum is the run's last one), bit for bit; the base model's differs."""
    from diffusers import QwenImageTransformer2DModel

    from trueflow.engine.weights import full_state, load_engine_transformer
    from trueflow.models import get_family
    from trueflow.models.qwen_image.train import model_timestep
    from trueflow.parity.probe import make_inputs
    from trueflow.sync.full_weights import weights_checksum
    from trueflow.train.model import train_forward

    out, rows = qwen_one
    export = out / "checkpoints" / "step-000002" / "transformer"
    trained = QwenImageTransformer2DModel.from_pretrained(export, torch_dtype=torch.bfloat16)
    base = QwenImageTransformer2DModel.from_pretrained(tiny_checkpoint / "transformer", torch_dtype=torch.bfloat16)
    engine = load_engine_transformer(str(tiny_checkpoint), patch_group="qwen_image")
    qwen = get_family("qwen_image")
    qwen.engine.load_weights(engine, load_file(str(export / "diffusion_pytorch_model.safetensors")))
    assert weights_checksum(full_state(engine)) == rows[-1]["trainer_checksum"], "the engine holds the last sync"
    inputs = make_inputs(trained.config, 4, 7, 64, torch.bfloat16, 0, "cpu")
    ts = model_timestep(inputs["timestep"], torch.bfloat16)
    with torch.no_grad():
        theirs = train_forward(qwen, trained, inputs["hidden_states"], ts, inputs["grid"], inputs["cond"])
        before = train_forward(qwen, base, inputs["hidden_states"], ts, inputs["grid"], inputs["cond"])
        ours = engine(hidden_states=inputs["hidden_states"], timestep=inputs["timestep"], grid=inputs["grid"],
                      **inputs["cond"])
    assert torch.equal(theirs, ours)
    assert not torch.equal(theirs, before), "the trained weights change the forward"


# -- the optimizer ------------------------------------------------------------------------------------------------
def test_lean_adamw_is_torch_adamw_up_to_its_moments_rounding():
    """With fp32 moments LeanAdamW is torch's AdamW bit for bit (the oracle: torch's single-tensor AdamW); with
    bf16 moments the update differs, by the moments' rounding only (relative 2^-9 each, so the weights stay close)."""
    from trueflow.train.optim import LeanAdamW

    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(64, generator=g), [torch.randn(64, generator=g) for _ in range(5)]

    def run(make):
        p = torch.nn.Parameter(start.clone())
        opt = make([p])
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
        return p.detach()

    theirs = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False))
    assert torch.equal(run(lambda ps: LeanAdamW(ps, lr=1e-2, weight_decay=0.1, moment_dtype=torch.float32)), theirs)
    lean = run(lambda ps: LeanAdamW(ps, lr=1e-2, weight_decay=0.1, moment_dtype=torch.bfloat16))
    assert not torch.equal(lean, theirs) and torch.allclose(lean, theirs, atol=5 * 1e-2 * 2**-8)


# -- the memory plan ----------------------------------------------------------------------------------------------
def test_the_memory_plan_is_the_docs_table_and_refuses_what_cannot_fit(tiny_checkpoint, tmp_path, capsys):
    from trueflow.train import memory

    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    assert f"<!-- memory-table -->\n{memory.table()}\n<!-- /memory-table -->" in docs, "regenerate the docs table"
    # The formula, by hand: 1e9 weights (8e8 trained), 10 blocks of 3e7, width 1000, 2 x 20000 tokens, 4 ranks.
    m = memory.Model(params=10**9, trained=8 * 10**8, unit=3 * 10**7, blocks=10, width=1000)
    s = memory.Setting(rows=2, tokens=20000, ema=True)
    sharded = (4 * 10**9 + (4 + 8 + 4) * 8 * 10**8) / 4  # masters; gradients, moments, EMA
    gathered_and_engine = 2 * 2 * 3 * 10**7 + 2 * 8 * 10**8
    train = sharded + gathered_and_engine + 2 * 20000 * 34 * 1000 * 10
    assert memory.peak_bytes(m, s, 4) == train
    ck = memory.Setting(rows=2, tokens=20000, ema=True, checkpointing=True)
    assert memory.peak_bytes(m, ck, 4) == sharded + gathered_and_engine + 2 * 20000 * 1000 * (2 * 10 + 34)
    sync = (4 * 10**9 + (8 + 4) * 8 * 10**8) / 64 + 2 * 2 * 8 * 10**8  # no gradients; two engine copies
    assert memory.peak_bytes(m, memory.Setting(rows=1, tokens=1, ema=True), 64) == sync
    assert memory.peak_bytes(m, memory.Setting(rows=1, tokens=1, ema=True, ema_offload=True, optimizer="adamw_bf16"),
                             64) == sync - (4 + 4) * 8 * 10**8 / 64
    assert memory.smallest_ranks(m, s, train / memory.USABLE) == 4 and memory.smallest_ranks(m, s, 1.0) is None
    # trueflow train refuses, before it loads or creates anything: one line, the numbers and the fixes, exit 2.
    out = tmp_path / "run"
    assert main(argv(tiny_checkpoint, out, dict(use_lora=False, gpu_memory_gib=0.005))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists(), err
    qwen = get_family("qwen_image")
    need = memory.peak_bytes(memory.from_checkpoint(qwen, tiny_checkpoint),
                             # 4 samples, twice: the default --cfg-scale 4 trains both branches with gradient
                             memory.Setting(rows=2 * 4, tokens=memory.sample_tokens(qwen, 64, 1)), 1)
    assert f"need {need / memory.GIB:.3g} GiB per GPU on 1 rank(s)" in err and "--gradient-checkpointing" in err
    assert "--optimizer adamw_bf16" in err and "over 90% of 0.005 GiB" in err


# -- the GPU script -----------------------------------------------------------------------------------------------
def test_the_gpu_script_runs_its_cpu_smoke_path(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    try:
        import gpu_fullft
    finally:
        sys.path.pop(0)
    results = gpu_fullft.main(["all", "--root", str(tmp_path), "--smoke"])
    full = results["full"]
    assert full["steps"] == 3 and full["bitwise_every_step"] and full["checksums_equal"]
    assert results["full"]["images_per_gpu_s"] > 0 and results["lora"]["images_per_gpu_s"] > 0
    assert results["resume"] == {"metrics_equal": True, "masters_equal": True, "export_equal": True}
