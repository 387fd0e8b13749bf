"""`trueflow serve --tp 2` (a subprocess on loopback, gloo): its rollouts are bitwise those of a tensor-parallel
`EngineClient(tp=2)` built here (the same request, another path to the same ranks' code), a LoRA update is
confirmed per rank and changes the rollout, what cannot work under TP is refused naming the fix, and SIGTERM during
a rollout answers 503 and leaves none of its processes behind."""

from __future__ import annotations

import base64
import io
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgpack
import numpy as np
import pytest
from PIL import Image

from test_ipc_safety import cuda_bucket, ipc_payload
from test_server import NO_LORA, assert_same_rollout, checksums, make_lora, serve_subprocess
from test_server_shutdown import LONG
from trueflow.placement import EngineSpec
from trueflow.cli import main
from trueflow.engine import wire
from trueflow.engine.interface import RolloutRequest
from trueflow.engine.sampling_params import SamplingParams
from trueflow.parallel import engine as parallel_engine
from trueflow.placement.http import push_lora, remote_rollout
from trueflow.http import MSGPACK
from trueflow.models import get_family
from trueflow.parallel.engine import lora_shard_checksums
from trueflow.sync.checksum import tensors_checksum
from trueflow.placement.process import EngineClient

from conftest import BF16, assert_differs, assert_loopback_only, listening, process_tree

REQUEST = RolloutRequest(["a red apple"], 2, SamplingParams(steps=2, num_sde_steps=1, height=32, width=32), seed=3)
SERVE = ("--tp", "2", "--threads", "1", "--patch-group", "qwen_image", "--max-steps", str(LONG["steps"]))


def children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.add(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_tp2_rollouts_lora_refusals_and_shutdown(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(parallel_engine, "_GATE_SAID", False)  # said once per process: maybe by an earlier test
    with pytest.warns(UserWarning, match="TP gate"):
        reference = EngineClient(EngineSpec(str(tiny_checkpoint), "qwen_image", threads=1), tp=2)
    try:
        with serve_subprocess(tiny_checkpoint, *SERVE) as (url, proc):
            health = httpx.get(f"{url}/health").json()
            assert (health["status"], health["tp"], health["threads"]) == ("ok", 2, 1)
            ranks = children(proc.pid) - {health["process"]}  # rank 0, and rank 1 among the rest
            assert health["process"] in children(proc.pid)

            served, expected = remote_rollout(url, REQUEST), reference.rollout(REQUEST)
            assert_same_rollout(served, expected)
            assert served.engine["lora_checksum"] == NO_LORA

            lora = make_lora(0)
            # Confirmed per rank: the LoRA's checksum, never one rank's slice (rank 0's differs from it).
            assert lora_shard_checksums(get_family("qwen_image"), lora, 2, BF16)[0] != tensors_checksum(lora)
            assert push_lora(url, lora, 1.0, "unmerged") == tensors_checksum(lora)
            assert reference.update_weights(lora, 1.0, "unmerged") == tensors_checksum(lora)
            assert checksums(url) == {"weights": None, "lora": tensors_checksum(lora)}
            with_lora = remote_rollout(url, REQUEST)
            assert_same_rollout(with_lora, reference.rollout(REQUEST))
            assert_differs(with_lora.microgroups[0].latents, served.microgroups[0].latents, "the LoRA's effect")
            assert with_lora.engine["lora_checksum"] == tensors_checksum(lora)
            r = httpx.post(f"{url}/v1/images/generations", timeout=60, json={
                "prompt": "a cat", "size": "32x32", "seed": 5, "steps": 2, "sampler": "ode"})
            assert r.status_code == 200, r.text
            png = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
            expected = reference.rollout(RolloutRequest(["a cat"], 1, SamplingParams(steps=2, sampler="ode",
                                                                                    height=32, width=32), 5))
            assert np.array_equal(png, expected.images[0].numpy())

            # What a multi-process engine cannot take: refused before anything is read or opened, naming the fix.
            r = httpx.post(f"{url}/weights/full", json={"path": "anything"})
            assert r.status_code == 400 and "--tp 1" in r.json()["error"], r.text
            r = httpx.post(f"{url}/weights/lora", content=ipc_payload(cuda_bucket()),
                           headers={"content-type": wire.IPC_CONTENT_TYPE})
            assert r.status_code == 400 and "CPU tensors" in r.json()["error"], r.text
            assert checksums(url)["lora"] == tensors_checksum(lora)

            # SIGTERM during a rollout: every rank stops at the same step, the client gets 503, nothing is left.
            answer = {}
            client = threading.Thread(target=lambda: answer.update(r=httpx.post(
                f"{url}/rollout/generate", content=msgpack.packb(LONG), headers={"content-type": MSGPACK},
                timeout=60)))
            client.start()
            deadline = time.monotonic() + 30
            while not httpx.get(f"{url}/health", timeout=5).json()["busy"]:
                assert time.monotonic() < deadline, "the rollout did not start"
                time.sleep(0.05)
            time.sleep(0.5)  # inside the denoising loop
            for pid in ranks | {health["process"]}:  # a terminal's Ctrl-C reaches the ranks too: theirs to ignore
                os.kill(pid, signal.SIGINT)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == -signal.SIGTERM
            client.join(10)
            assert answer["r"].status_code == 503, answer["r"].text
            assert answer["r"].json()["error"] == "the server is shutting down; the request was stopped while it ran"
            deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves once its parent is gone
            while [p for p in ranks | {health["process"]} if alive(p)] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [p for p in ranks | {health["process"]} if alive(p)]
            log = proc.stdout.read().decode()  # at its end: no process holds the pipe any more
            assert "Traceback" not in log, log
    finally:
        reference.shutdown()


def test_serve_tp_refuses_bad_combinations_in_one_line(tiny_checkpoint, capsys):
    for flags, says in [(["--tp", "3"], "--tp 3 does not divide the 2 attention heads"),
                        (["--tp", "0"], "--tp must be >= 1, got 0"),
                        (["--tp", "2", "--device", "cuda:1"], "takes --device cuda (rank r runs on GPU r)")]:
        assert main(["serve", "--checkpoint", str(tiny_checkpoint), *flags]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


def test_health_says_failed_once_an_engine_process_has_died(tiny_checkpoint):
    """A dead rank fails every engine call: /health says so (503), as a load balancer needs to see."""
    from fastapi.testclient import TestClient

    from trueflow.server import create_app

    class Ranks:  # the part of EngineClient the health reads: what it runs, and its processes
        processes = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=None)]

        def health(self) -> dict:
            return {"checkpoint": str(tiny_checkpoint), "family": "qwen_image", "tp": 2}

    engine = Ranks()
    with TestClient(create_app(engine, threads=1)) as client:
        assert client.get("/health").json()["status"] == "ok"
        engine.processes[1].exitcode = -9
        r = client.get("/health")
        assert (r.status_code, r.json()["status"], r.json()["tp"]) == (503, "failed", 2)


def test_a_dead_rank_is_one_line_503_and_sigterm_is_quick(tiny_checkpoint):
    """The server, its engine process and its ranks listen on loopback only; a rank killed by SIGKILL answers the
    next rollout 503 "engine rank 1 of 2 died" (no traceback in the answer), /health says failed, and SIGTERM then
    ends the server and the surviving rank in under 5 s."""
    with serve_subprocess(tiny_checkpoint, "--tp", "2", "--threads", "1") as (url, proc):
        health = httpx.get(f"{url}/health").json()
        assert_loopback_only(listening(process_tree(proc.pid)))
        ranks = health["processes"]
        assert len(ranks) == 2 and ranks[0] == health["process"]
        os.kill(ranks[1], signal.SIGKILL)
        r = httpx.post(f"{url}/rollout/generate", content=msgpack.packb(
            {"prompts": ["a cat"], "n_per_prompt": 1, "seed": 0, "steps": 2, "height": 32, "width": 32}),
            headers={"content-type": MSGPACK}, timeout=60)
        assert r.status_code == 503 and r.json() == {"error": "engine rank 1 of 2 died (exit code -9)"}, r.text
        assert httpx.get(f"{url}/health").json()["status"] == "failed"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert time.monotonic() - start < 5.0
        deadline = time.monotonic() + 10  # reaped by now: the server killed and joined its rank
        while alive(ranks[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(ranks[0])
