"""`trueflow train` end to end on the tiny checkpoint: bitwise parity at every optimizer step, what breaks it,
and the placement that must not change a single bit (engine process, 2 FSDP ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import assert_matches_recorded_run
from trueflow.train.config import ParityConditionWarning, TrainConfig, config_from_argv
from trueflow.net import free_port
from trueflow.train.lock import LOCK_FILE
from trueflow.train.metrics import TIMING_KEYS, read_metrics
from trueflow.train.run import run_training

# Small but complete: 2 prompts x 4 samples (two microgroups), 3 steps, one SDE step per trajectory.
FAST = dict(steps=3, num_sde_steps=1, rollout_batch_size=2, n_samples_per_prompt=4, rollout_microgroup_size=4,
            micro_batch_size_sample=4, sample_every=1)


def config(tmp_path, checkpoint, **overrides) -> TrainConfig:
    return TrainConfig(**{"output_dir": str(tmp_path / "run"), "checkpoint": str(checkpoint), **FAST, **overrides})


def train(tmp_path, checkpoint, **overrides) -> list[dict]:
    run_training(config(tmp_path, checkpoint, **overrides))
    return read_metrics(tmp_path / "run" / "metrics.jsonl")


def cli_flags(**settings) -> list[str]:
    out = []
    for k, v in settings.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics without wall-clock times (the only keys that may differ between placements or after a resume)."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def assert_bitwise_run(rows: list[dict], n: int) -> None:
    assert len(rows) == n
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["model_output_mean_abs_diff"] == 0.0, r
        assert r["log_prob_max_abs_diff"] == 0.0
        assert r["ratio_mean"] == 1.0 and r["ratio_max_abs_dev_from_1"] == 0.0 and r["clip_frac"] == 0.0
        assert r["lora_update_norm"] > 0, "the weights really changed"
        assert r["checksums_equal"] and r["trainer_checksum"] == r["engine_checksum"]


# -- the embedded default ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded_run(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embedded")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParityConditionWarning)  # the aligned defaults break no condition
        rows = train(tmp, tiny_checkpoint, num_rollouts=3, save_every=1, debug=True)  # debug: rollout snapshots
    return tmp / "run", rows


def test_embedded_run_is_bitwise_at_every_step(embedded_run):
    out, rows = embedded_run
    assert_bitwise_run(rows, 3)
    assert_matches_recorded_run(out, "qwen_image_embedded")
    assert len({r["trainer_checksum"] for r in rows}) == 3, "each sync carried new weights"
    summary = (out / "summary.md").read_text()
    assert "exactly 0.0 at every step" in summary and (out / "reward_curve.png").is_file()
    assert sorted(p.name for p in (out / "samples").glob("*.png")) == [f"rollout-0000{i}.png" for i in range(3)]


def test_checkpoint_loads_in_diffusers_and_reproduces_the_trained_forward(embedded_run, tiny_checkpoint):
    """diffusers' `load_lora_weights` takes the saved LoRA; its forward equals the engine's with the same
    adapter (bitwise, the qwen_image group), which equals the trainer's compute copy (the run's 0.0)."""
    from diffusers import QwenImagePipeline

    from trueflow.parity.probe import make_inputs
    from trueflow.train.checkpoint import latest_checkpoint, load_checkpoint
    from trueflow.models import get_family
    from trueflow.train.model import train_forward
    from trueflow.models.qwen_image.train import model_timestep
    from trueflow.engine.weights import load_engine_transformer
    from trueflow.models.lora import update_lora

    out, _ = embedded_run
    ckpt = latest_checkpoint(out)
    assert ckpt.name == "step-000003"
    pipe = QwenImagePipeline.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)
    qwen = get_family("qwen_image")
    inputs = make_inputs(pipe.transformer.config, 4, 7, 64, torch.bfloat16, 0, "cpu")
    ts = model_timestep(inputs["timestep"], torch.bfloat16)
    with torch.no_grad():
        base = train_forward(qwen, pipe.transformer, inputs["hidden_states"], ts, inputs["grid"], inputs["cond"])
        pipe.load_lora_weights(ckpt)
        trained = train_forward(qwen, pipe.transformer, inputs["hidden_states"], ts, inputs["grid"], inputs["cond"])
    engine = load_engine_transformer(tiny_checkpoint, patch_group="qwen_image")
    lora, _, _ = load_checkpoint(ckpt)
    update_lora(engine, {k: v.to(torch.bfloat16) for k, v in lora.items()}, scale=1.0)
    with torch.no_grad():
        ours = engine(hidden_states=inputs["hidden_states"], timestep=inputs["timestep"], grid=inputs["grid"],
                      **inputs["cond"])
    assert torch.equal(trained, ours)
    assert not torch.equal(trained, base), "the trained LoRA changes the forward"


def torchrun(out, checkpoint, *flags: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m trueflow train` with the FAST settings, on loopback."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    # An explicit free port: torchrun's `--master-port 0` leaves the ranks waiting for each other.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "trueflow", "train", "--checkpoint", str(checkpoint),
           "--output-dir", str(out), "--num-rollouts", "3", *cli_flags(**FAST), *flags]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def assert_same_metrics(rows: list[dict], embedded: list[dict]) -> None:
    """Placement changes nothing: the same weights (checksums), rewards and parity metrics, bit for bit, as the
    one-process run. Only sums over sharded or per-rank pieces (grad norm, mean loss) are added in another order,
    so they agree to float rounding."""
    order_dependent = ("grad_norm", "loss", "kl")

    def exact(rs: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in order_dependent} for r in comparable(rs)]

    assert exact(rows) == exact(embedded)
    for r, e in zip(rows, embedded):
        for k in order_dependent:
            assert r[k] == pytest.approx(e[k], rel=1e-5, abs=1e-7), k


def test_two_ranks_each_roll_out_their_own_share(embedded_run, tiny_checkpoint, tmp_path):
    """torchrun, 2 gloo ranks, an engine in each rank's process: each engine rolls out only its rank's prompt (its
    snapshots hold that prompt's 4 samples alone), the run is bitwise at every step and exits 0, and the samples
    equal the one-rank run's bit for bit (log-probs, latents, rewards), as do the metrics."""
    from safetensors import safe_open

    embedded_out, embedded = embedded_run
    out = tmp_path / "run"
    proc = torchrun(out, tiny_checkpoint, "--debug")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / LOCK_FILE).exists(), "rank 0 held the run folder's lock (rank 1 never refused) and released it"
    rows = read_metrics(out / "metrics.jsonl")
    assert_bitwise_run(rows, 3)
    assert_same_metrics(rows, embedded)
    for index in range(3):
        with safe_open(embedded_out / "snapshots" / f"rollout-{index:05d}.safetensors", "pt") as f:
            whole = {k: f.get_tensor(k) for k in f.keys()}
        for rank in (0, 1):
            with safe_open(out / "snapshots" / f"rollout-{index:05d}-rank{rank}.safetensors", "pt") as f:
                meta = json.loads(f.metadata()["trueflow"])
                share = {k: f.get_tensor(k) for k in f.keys()}
            assert meta["first_prompt"] == rank and meta["n_per_prompt"] == 4 and len(meta["prompts"]) == 1
            assert [mg["sample_indices"] for mg in meta["microgroups"]] == [[0, 1, 2, 3]]
            # The rank's microgroup is microgroup `rank` of the one-rank rollout, bit for bit.
            for key in ("log_probs", "rewards", "final_latents", "step0/latents"):
                assert torch.equal(share[f"mg0/{key}"], whole[f"mg{rank}/{key}"]), (index, rank, key)


def test_two_fsdp_ranks_with_the_engine_in_its_own_process(embedded_run, tiny_checkpoint, tmp_path):
    """The acceptance run: torchrun, 2 gloo ranks, LoRA synced to an engine process by shared-memory handles:
    bitwise at every step, and the very metrics of the one-process run."""
    _, embedded = embedded_run
    out = tmp_path / "run"
    proc = torchrun(out, tiny_checkpoint, "--engine-process")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert_bitwise_run(rows, 3)
    assert_same_metrics(rows, embedded)


# -- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, fix", [
    (dict(n_samples_per_prompt=6), "multiple of --rollout-microgroup-size"),
    (dict(num_sde_steps=9), "--num-sde-steps"),
    (dict(use_lora=False, kl_beta=0.1), "KL reference of a full fine-tune"),
    (dict(resolution=60), "multiple of 16"),
])
def test_invalid_settings_are_refused_with_the_fix(tmp_path, tiny_checkpoint, overrides, fix):
    with pytest.raises(ValueError, match=fix):
        config(tmp_path, tiny_checkpoint, **overrides).validate()


def test_flags_and_yaml_fill_the_same_config(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("optim:\n  lr: 0.5\nrollout:\n  steps: 7\n")
    cfg = config_from_argv(["--config", str(yaml_file), "--steps", "5", "--patch-group", "none"])
    assert (cfg.lr, cfg.steps, cfg.rollout_patch_group) == (0.5, 5, "none")  # flags override the file
    yaml_file.write_text("optim:\n  lrr: 1\n")
    with pytest.raises(ValueError, match="unknown setting"):
        config_from_argv(["--config", str(yaml_file)])


def test_the_aligned_recipe_breaks_no_condition():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sections, not the flat layout
        cfg = config_from_argv(["--config", "recipes/bitwise-aligned.yaml"])
    assert cfg.parity_warnings() == []


def test_an_existing_run_is_not_overwritten(embedded_run, tiny_checkpoint):
    out, _ = embedded_run
    with pytest.raises(FileExistsError, match="--resume"):
        run_training(TrainConfig(output_dir=str(out), checkpoint=str(tiny_checkpoint), **FAST))


def test_reward_in_the_engine_process(embedded_run, tiny_checkpoint, tmp_path):
    """Placing the reward in the engine process changes where it runs, not a single metric."""
    _, embedded = embedded_run
    rows = train(tmp_path, tiny_checkpoint, num_rollouts=1, engine_process=True, reward_placement="engine")
    assert comparable(rows) == comparable(embedded[:1])
    with pytest.raises(ValueError, match="needs --engine-process"):
        config(tmp_path, tiny_checkpoint, reward_placement="engine").validate()
