"""A new user's first hour, as one script: make the tiny checkpoint, train 2 rollouts, look at the trained policy with
`generate --lora`, then serve it with `serve --lora` and ask the official openai client for the same image. The
trained LoRA changes the images, and both verbs give the same PNG bytes for the same seed and prompt."""

from __future__ import annotations

import base64
import json
import os
import socket
import stat
import subprocess
import time

import httpx
import openai
import pytest

from conftest import TEST_THREADS, TRUEFLOW_EXE
from trueflow.cli import main
from trueflow.train.metrics import read_metrics

PROMPT, SEED = "a red cube on a wooden table", 5
# Tiny settings: 2 rollouts of 1 prompt x 2 samples, 2 steps; LoRA alpha 2 x rank, so its scale (2) matters.
TRAIN = ["--num-rollouts", "2", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
         "--rollout-microgroup-size", "2", "--micro-batch-size-sample", "2", "--steps", "2", "--num-sde-steps", "1",
         "--lora-rank", "4", "--lora-alpha", "8", "--lr", "0.02", "--threads", str(TEST_THREADS)]
SAMPLE = ["--prompt", PROMPT, "--seed", str(SEED), "--steps", "2", "--threads", str(TEST_THREADS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_train_then_sample_the_trained_policy_from_generate_and_serve(tmp_path, capsys):
    ckpt, run = tmp_path / "tiny", tmp_path / "run"
    assert main(["init-checkpoint", "--output-dir", str(ckpt)]) == 0
    assert main(["train", "--checkpoint", str(ckpt), "--output-dir", str(run), *TRAIN]) == 0
    err = capsys.readouterr().err
    assert all(f"{k}=" in err for k in ("loss", "kl", "lr", "reward", "diff")), err[-500:]  # the progress bar
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 2 and all(r["model_output_max_abs_diff"] == 0.0 and "timestamp" in r for r in rows)
    for f in [*ckpt.rglob("*"), *run.rglob("*")]:  # readable like any file the user makes (safetensors too)
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f

    assert main(["generate", "--checkpoint", str(ckpt), *SAMPLE, "--output-dir", str(tmp_path / "base")]) == 0
    assert main(["generate", "--checkpoint", str(ckpt), *SAMPLE, "--lora", str(run),
                 "--output-dir", str(tmp_path / "trained")]) == 0
    base, trained = ((tmp_path / d / "0000.png").read_bytes() for d in ("base", "trained"))
    assert trained != base, "the trained LoRA changes nothing"
    settings = json.loads((tmp_path / "trained" / "settings.json").read_text())
    assert settings["engine"]["patch_group"] == "qwen_image"  # the family's parity group, unasked
    assert settings["lora"]["scale"] == 2.0 and settings["lora"]["path"].endswith(
        "checkpoints/step-000002/pytorch_lora_weights.safetensors")

    port = free_port()
    proc = subprocess.Popen([str(TRUEFLOW_EXE), "serve", "--checkpoint", str(ckpt), "--lora", str(run), "--port",
                             str(port), "--threads", str(TEST_THREADS)],
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "trueflow serve did not answer within 90 s"
            try:
                httpx.get(f"{url}/health", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [ckpt.name]
        out = client.images.generate(prompt=PROMPT, size="64x64", quality="standard", user="new-user",
                                     extra_body={"seed": SEED, "steps": 2})
        assert out.seed == SEED
        assert base64.b64decode(out.data[0].b64_json) == trained  # the same bytes as generate --lora
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0].decode()
    assert "LoRA" in log and "installed" in log and "Traceback" not in log, log[-2000:]
