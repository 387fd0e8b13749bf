"""`trueflow serve` in a subprocess on loopback, busy with a rollout of minutes: SIGTERM or SIGINT makes it stop
taking work, stop the rollout, answer its client 503 and exit within 10 seconds."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import msgpack
import pytest

from test_server import serve_subprocess
from trueflow.http import MSGPACK

LONG = {"prompts": ["a cat"], "n_per_prompt": 1, "seed": 0, "steps": 100_000, "height": 32, "width": 32,
        "sampler": "ode", "cfg_scale": 1.0, "decode": False}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_busy_server_exits_on_a_signal(tiny_checkpoint, sig):
    with serve_subprocess(tiny_checkpoint, "--max-steps", str(LONG["steps"])) as (url, proc):
        answer = {}

        def long_request() -> None:
            try:
                answer["r"] = httpx.post(f"{url}/rollout/generate", content=msgpack.packb(LONG),
                                         headers={"content-type": MSGPACK}, timeout=60)
            except httpx.HTTPError as e:
                answer["r"] = e

        client = threading.Thread(target=long_request)
        client.start()
        deadline = time.monotonic() + 30
        while not httpx.get(f"{url}/health", timeout=5).json()["busy"]:
            assert time.monotonic() < deadline, "the rollout did not start"
            time.sleep(0.05)
        proc.send_signal(sig)
        start = time.monotonic()
        rc = proc.wait(10)  # raises TimeoutExpired past 10 s
        assert time.monotonic() - start < 10
        assert rc in (0, -signal.SIGTERM), (rc, proc.stdout.read().decode())  # SIGTERM: uvicorn re-raises it
        client.join(10)
        r = answer["r"]  # answered, not dropped: the rollout stopped at its next step
        assert not isinstance(r, Exception) and r.status_code == 503, r
        assert r.json()["error"] == "the server is shutting down; the request was stopped while it ran"
        log = proc.stdout.read().decode()
        assert "Traceback" not in log, log
