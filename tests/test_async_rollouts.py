"""`--async-rollouts 1` (one step off) with the engine in its own process, on the tiny checkpoint: rollout k is made
with W_{k-1} while the trainer trains on rollout k-1, and the trainer re-scores it at the kept copy of W_{k-1}
bitwise at every step (the recorded log-probs are the exact behaviour policy's); the current weights, one version
off, differ. A run SIGKILLed while a rollout is in flight resumes bit for bit; bad settings are one line each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_train import comparable, config
from test_train_errors import assert_one_line_error
from test_train_errors import train as cli_train

from trueflow.train.metrics import read_metrics
from trueflow.train.run import run_training

# 3 rollouts of 1 prompt x 2 samples, one SDE step, a checkpoint after every rollout.
ASYNC = dict(steps=2, num_sde_steps=1, rollout_batch_size=1, n_samples_per_prompt=2, rollout_microgroup_size=2,
             micro_batch_size_sample=2, sample_every=0, num_rollouts=3, save_every=1, engine_process=True,
             async_rollouts=1)


def _flags(settings: dict) -> list[str]:
    out = []
    for k, v in settings.items():
        flag = f"--{k.replace('_', '-')}"
        out += [flag] if v is True else [flag, str(v)]
    return out


@pytest.fixture(scope="module")
def async_run(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    cfg = config(tmp, tiny_checkpoint, **ASYNC)
    run_training(cfg)
    return tmp / "run", read_metrics(tmp / "run" / "metrics.jsonl")


def test_every_step_rescores_the_behaviour_version_bitwise_and_the_current_one_differs(async_run):
    _, rows = async_run
    assert len(rows) == 3
    # v(j) = max(0, j - 1): rollouts 0 and 1 by W_0, rollout 2 by W_1; staleness min(j, 1).
    assert [r["behaviour_version"] for r in rows] == [0, 0, 1]
    assert [r["staleness"] for r in rows] == [0, 1, 1]
    for r in rows:
        assert r["parity_measured"], r
        assert r["model_output_max_abs_diff"] == 0.0 and r["model_output_mean_abs_diff"] == 0.0, r
        assert r["log_prob_max_abs_diff"] == 0.0 and r["ratio_mean"] == 1.0 and r["ratio_max_abs_dev_from_1"] == 0.0
        assert r["checksums_equal"] and r["trainer_checksum"] == r["engine_checksum"], r
        assert r["lora_update_norm"] > 0
        assert r["time_wait"] >= 0
    # The version's checksum goes with the rollout: one version made rollouts 0 and 1, another rollout 2.
    assert rows[0]["engine_checksum"] == rows[1]["engine_checksum"] != rows[2]["engine_checksum"]
    # On-policy (rollout 0, staleness 0) the behaviour weight is exactly 1 and the current policy is μ.
    assert rows[0]["is_weight_mean"] == 1.0 and rows[0]["is_truncated_frac"] == 0.0
    assert rows[0]["policy_log_prob_max_abs_diff"] == 0.0
    # The failure side: the wrong weight version (the current W_k, one step ahead of the rollout's) is non-zero,
    # and so is the behaviour correction min(ρ̄, π_prox/μ) it feeds.
    for r in rows[1:]:
        assert r["policy_log_prob_max_abs_diff"] > 0, r
        assert r["is_weight_mean"] != 1.0, r


def test_a_killed_async_run_resumes_bit_for_bit(async_run, tiny_checkpoint, tmp_path):
    """SIGKILLed (the run and its engine process) once checkpoint 1 is written: rollout 1 was in flight with W_0.
    The resumed run redoes it with the checkpoint's kept W_0, and every metric equals the uninterrupted run's."""
    _, reference = async_run
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trueflow", "train", "--checkpoint", str(tiny_checkpoint), "--output-dir", str(out),
           *_flags(ASYNC)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: the kill takes its engine process too
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "step-000001" / "COMPLETE").exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    killed = read_metrics(out / "metrics.jsonl")
    assert len(killed) < 3, "killed before the run's end"
    run_training(config(tmp_path, tiny_checkpoint, **ASYNC, resume=True))
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(reference)


@pytest.mark.parametrize("settings, fix", [
    (dict(engine_process=False), "run the engine outside the trainer's process (--engine-process"),
    (dict(num_steps_per_rollout=2), "takes --num-steps-per-rollout 1"),
    (dict(no_use_lora=True), "a LoRA's, not a whole transformer's; drop --no-use-lora"),
])
def test_unsupported_async_settings_are_one_line(tmp_path, tiny_checkpoint, capsys, settings, fix):
    argv = ["--checkpoint", str(tiny_checkpoint), "--output-dir", str(tmp_path / "run"),
            *_flags({k: v for k, v in {**ASYNC, **settings}.items() if v is not False})]
    rc, _, err = cli_train(capsys, *argv)
    assert_one_line_error(rc, err, "--async-rollouts 1", fix)
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before anything ran"
