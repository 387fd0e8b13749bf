"""Engine placement has one home: the registry maps each placement name to a builder imported when first used, the
typed specs refuse a placement that cannot run, every implementation takes the interface's `should_stop` (none
refuses it), and the client side imports no server stack."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from trueflow.engine.engine import Engine
from trueflow.engine.interface import EngineWrapper, RolloutCancelled, RolloutRequest
from trueflow.engine.sampling_params import SamplingParams
from trueflow.http import serve_in_thread
from trueflow.placement import PLACEMENTS, EngineSpec, Placement, RewardSpec, build_engine
from trueflow.placement.http import HttpEngine
from trueflow.server import Limits, create_app

from conftest import assert_bitwise

REQUEST = RolloutRequest(["a red apple"], 2, SamplingParams(steps=3, sampler="sde", cfg_scale=1.0), seed=5)
LONG = RolloutRequest(["a red apple"], 2, SamplingParams(steps=40, sampler="sde", cfg_scale=1.0), seed=5)  # seconds


def _imported(code: str) -> set[str]:
    """The modules a fresh interpreter holds after `code`."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return set(out.stdout.split())


def test_the_client_and_the_request_types_import_nothing_heavy():
    client = _imported("import trueflow.placement.http")
    assert not {m for m in client if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}, "the HTTP client"
    leaves = _imported("import trueflow.engine.sampling_params, trueflow.engine.request, trueflow.placement.spec")
    assert not {m for m in leaves if m.startswith("trueflow.models")}, "a family module"
    assert "torch" not in leaves, "the request types are leaves"
    registry = _imported("import trueflow.placement")
    assert not {m for m in registry if m.split(".")[0] in ("ray", "httpx", "fastapi")}, "the registry imports lazily"


def test_every_placement_name_has_a_builder_and_a_bad_one_is_refused(tiny_checkpoint):
    from trueflow.placement import _builder

    assert set(PLACEMENTS) == {"local", "process", "tp", "http", "ray_colocated", "ray_disaggregated"}
    for name in PLACEMENTS:
        assert callable(_builder(name)), name
    with pytest.raises(ValueError, match="unknown engine placement 'gpu'; choose one of local, process"):
        build_engine(EngineSpec(str(tiny_checkpoint)), Placement("gpu"))


@pytest.mark.parametrize("placement, fix", [
    (dict(kind="local", tp=2), "that is the `process` placement"),
    (dict(kind="local", reward_at="engine", reward=RewardSpec("redness")), "needs the engine in a process"),
    (dict(kind="process", reward_at="actor", reward=RewardSpec("redness")), "needs a Ray placement"),
    (dict(kind="process", reward_at="engine"), "but no reward is given"),
    (dict(kind="http"), "needs the server's URL"),
    (dict(kind="process", tp=0), "--tp must be >= 1"),
])
def test_a_placement_that_cannot_run_is_refused_in_one_line(placement, fix):
    with pytest.raises(ValueError, match=fix):
        Placement(**placement)


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown dtype 'fp16'; choose one of bf16, fp32"):
        EngineSpec("ckpt", dtype="fp16")


class _StopAfter:
    """A `should_stop` that says yes from its n-th question on, and remembers being asked."""

    def __init__(self, n: int):
        self.n, self.asked = n, 0
        self.lock = threading.Lock()

    def __call__(self) -> bool:
        with self.lock:
            self.asked += 1
            return self.asked >= self.n


class _Slow(EngineWrapper):
    """An engine whose every denoising step takes at least STEP_S (its rollout's should_stop sleeps), so that a
    caller's stop reliably arrives while it runs."""

    STEP_S = 0.05

    def rollout(self, request, should_stop=None):
        def slow() -> bool:
            time.sleep(self.STEP_S)
            return should_stop is not None and should_stop()

        return self.engine.rollout(request, slow)


def test_a_served_rollout_stops_when_its_caller_says_so(tiny_checkpoint):
    """Over HTTP, `should_stop` closes the connection and the server stops the rollout at its next step (long before
    its 40 steps of at least 50 ms); the server then serves the same request bit for bit."""
    local = Engine(tiny_checkpoint, "qwen_image")
    app = create_app(_Slow(local), Limits(max_samples=8))
    with serve_in_thread(app) as url:
        engine = HttpEngine(url)
        t0 = time.monotonic()
        with pytest.raises(RolloutCancelled):
            engine.rollout(LONG, lambda: app.state.worker.running is not None)  # once the server runs it
        assert time.monotonic() - t0 < 40 * _Slow.STEP_S, "stopped mid-rollout"
        again = engine.rollout(REQUEST, lambda: False)
    assert_bitwise(again.microgroups[0].latents, local.rollout(REQUEST).microgroups[0].latents, "after a stop")


def test_a_scored_engine_process_takes_should_stop(tiny_checkpoint):
    """The engine in its own process that scores its rollouts stops like any other (it used to refuse): asked before
    the first step, the ranks stop there."""
    engine = build_engine(EngineSpec(str(tiny_checkpoint), "qwen_image", threads=1),
                          Placement("process", reward=RewardSpec("redness"), reward_at="engine"))
    try:
        with pytest.raises(RolloutCancelled):
            engine.rollout(LONG, lambda: True)
        scored = engine.rollout(REQUEST, lambda: False)
        assert scored.rewards.shape == (2,) and scored.dropped == []
    finally:
        engine.shutdown()
