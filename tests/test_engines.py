"""One engine interface: the trainer runs the same 2-rollout training through an engine in its process, in its own
process and behind `trueflow serve`, and gets the same metrics bit for bit; the interface's calls behave alike."""

from __future__ import annotations

import pytest
import torch

from trueflow.placement import EngineSpec
from trueflow.engine.engine import Engine
from trueflow.placement.http import HttpEngine
from trueflow.engine.interface import RolloutRequest
from trueflow.placement.scored import ScoredEngine
from trueflow.engine.sampling_params import SamplingParams
from trueflow.server import Limits, create_app
from trueflow.http import serve_in_thread
from trueflow.rewards.base import build_reward
from trueflow.sync.checksum import tensors_checksum
from trueflow.placement.process import EngineClient
from trueflow.train.metrics import read_metrics
from trueflow.train.run import run_training

from conftest import assert_bitwise
from test_train import assert_bitwise_run, comparable, config

TWO_ROLLOUTS = dict(num_rollouts=2, sample_every=0)


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    """A server running what the trainer's own engine would (the family's patch group, bf16, this process's threads)."""
    with serve_in_thread(create_app(Engine(tiny_checkpoint, "qwen_image"), Limits(max_samples=8))) as url:
        yield url


def _train(tmp_path, checkpoint, name: str, **placement) -> list[dict]:
    cfg = config(tmp_path / name, checkpoint, **TWO_ROLLOUTS, **placement)
    run_training(cfg)
    return read_metrics(tmp_path / name / "run" / "metrics.jsonl")


def test_the_three_engines_train_alike(tmp_path, tiny_checkpoint, served):
    local = _train(tmp_path, tiny_checkpoint, "local")
    assert_bitwise_run(local, 2)
    own = _train(tmp_path, tiny_checkpoint, "own", engine_process=True)
    http = _train(tmp_path, tiny_checkpoint, "http", engine_url=[served])
    assert comparable(own) == comparable(local)
    assert comparable(http) == comparable(local)


def test_a_served_engine_that_runs_other_settings_is_refused(tmp_path, tiny_checkpoint, served):
    with pytest.raises(ValueError, match=r"runs patch_group 'qwen_image' \(this run: 'none'\)"):
        run_training(config(tmp_path, tiny_checkpoint, engine_url=[served], rollout_patch_group="none"))
    with pytest.raises(ValueError, match="give one per rank"):
        run_training(config(tmp_path, tiny_checkpoint, engine_url=[served, served]))
    with pytest.raises(ValueError, match="no engine server answers at http://127.0.0.1:9"):
        HttpEngine("http://127.0.0.1:9")


def test_the_interface_calls_answer_alike(tiny_checkpoint, served):
    """rollout, update_weights (one checksum: the update's answer), checksum and health through each front end;
    a scored engine adds rewards and keeps the rollout bit for bit."""
    lora = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.full((2, 64), 0.01, dtype=torch.bfloat16),
            "transformer_blocks.0.attn.to_q.lora_B.weight": torch.full((64, 2), 0.02, dtype=torch.bfloat16)}
    request = RolloutRequest(["a red apple"], 2, SamplingParams(steps=2, sampler="sde", cfg_scale=1.0), seed=3)
    local, own = Engine(tiny_checkpoint, "qwen_image"), EngineClient(EngineSpec(str(tiny_checkpoint), "qwen_image"))
    try:
        engines = {"local": local, "own": own, "http": HttpEngine(served)}
        for name, engine in engines.items():
            assert engine.update_weights(lora, 1.0, "unmerged") == tensors_checksum(lora) == engine.checksum(), name
            health = engine.health()
            assert (health["status"], health["family"], health["patch_group"]) == ("ok", "qwen_image", "qwen_image")
        rollouts = {name: engine.rollout(request) for name, engine in engines.items()}
        for name in ("own", "http"):
            assert_bitwise(rollouts[name].images, rollouts["local"].images, name)
            assert_bitwise(rollouts[name].microgroups[0].log_probs, rollouts["local"].microgroups[0].log_probs, name)
        scored = ScoredEngine(local, build_reward("redness", None, "cpu")).rollout(request)
        assert_bitwise(scored.images, rollouts["local"].images, "scored")
        assert scored.rewards.shape == (2,) and scored.dropped == [] and scored.times["reward"] >= 0
        assert rollouts["local"].rewards is None
    finally:
        own.shutdown()
        own.shutdown()  # a second call does nothing


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited one left unreaped, a zombie, counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_an_engine_process_leaves_when_its_client_is_killed(tiny_checkpoint):
    """A trainer or server SIGKILLed never says "close": its idle engine process sees the parent gone and exits,
    instead of holding the device's memory as an orphan."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pids: list[int] = []
    code = (f"from trueflow.placement import EngineSpec\nfrom trueflow.placement.process import EngineClient\n"
            f"c = EngineClient(EngineSpec({str(tiny_checkpoint)!r}, threads=1))\n"
            f"print(*[p.pid for p in c.processes], flush=True)\n"
            f"import time; time.sleep(120)\n")
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in client.stdout.readline().split()]
        assert pids and all(map(_running, pids))
        client.send_signal(signal.SIGKILL)
        client.wait()
        deadline = time.monotonic() + 20
        while any(map(_running, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_running, pids)), "the engine process outlived its killed client"
    finally:
        client.kill()
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
