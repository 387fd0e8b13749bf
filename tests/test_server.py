"""The engine server on loopback (uvicorn in a thread, and `trueflow serve` in a subprocess), through a real HTTP
client: rollouts bitwise equal to the in-process engine's (alone or concurrent), OpenAI-style images, weight
updates by safetensors path and by IPC handles, serialised with rollouts, and refused requests that change nothing."""

from __future__ import annotations

import base64
import contextlib
import io
import math
import os
import re
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

import httpx
import msgpack
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from conftest import BF16, TEST_THREADS, TRUEFLOW_EXE, assert_bitwise, assert_differs, randn
from trueflow.engine.interface import RolloutRequest
from trueflow.engine import wire
from trueflow.engine.engine import Engine
from trueflow.engine.sampling_params import SamplingParams
from trueflow.placement.http import ServerError, push_lora, push_weights, remote_rollout
from trueflow.server import Limits, create_app
from trueflow.engine.trajectory import Microgroup, Rollout, StepRecord
from trueflow.http import MSGPACK, serve_in_thread
from trueflow.loading import read_transformer_state_dict
from trueflow.sync.checksum import tensors_checksum
from trueflow.sync.shm import SharedSegments

# Small and fast, but with CFG, an SDE window (log-probs, guided outputs) and two microgroups per prompt.
PARAMS = SamplingParams(steps=2, num_sde_steps=1, height=32, width=32, rollout_microgroup_size=1)
NO_LORA = tensors_checksum({})


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> Engine:
    """The in-process engine every server answer is compared with (never updated)."""
    return Engine(tiny_checkpoint)


@pytest.fixture(scope="module")
def url(tiny_checkpoint):
    """A server whose weights no test changes."""
    with serve_in_thread(create_app(Engine(tiny_checkpoint), Limits(max_samples=8))) as url:
        yield url


@pytest.fixture
def fresh_url(tiny_checkpoint, tmp_path_factory):
    """A server of its own, for tests that update weights; path updates may read the session's temp folders."""
    with serve_in_thread(create_app(Engine(tiny_checkpoint), weights_root=tmp_path_factory.getbasetemp())) as url:
        yield url


def make_lora(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A bf16 LoRA under diffusers names: one slot of a packed q/k/v layer and one plain layer."""
    out = {}
    for i, (module, d_in, d_out) in enumerate([("transformer_blocks.0.attn.to_q", 64, 64),
                                               ("transformer_blocks.1.img_mlp.net.2", 256, 64)]):
        out[f"{module}.lora_A.weight"] = randn((rank, d_in), seed + 2 * i, std=0.1)
        out[f"{module}.lora_B.weight"] = randn((d_out, rank), seed + 2 * i + 1, std=0.1)
    return out


def assert_same_rollout(actual: Rollout, expected: Rollout) -> None:
    """Every field bitwise; the server adds the LoRA checksum to the engine info."""
    assert (actual.prompts, actual.n_per_prompt, actual.params, actual.seed) == \
        (expected.prompts, expected.n_per_prompt, expected.params, expected.seed)
    assert {k: v for k, v in actual.engine.items() if k != "lora_checksum"} == expected.engine
    if expected.images is None:
        assert actual.images is None
    else:
        assert_bitwise(actual.images, expected.images, "images")
    assert len(actual.microgroups) == len(expected.microgroups)
    for m, (a, e) in enumerate(zip(actual.microgroups, expected.microgroups)):
        for f in fields(Microgroup):
            x, y = getattr(a, f.name), getattr(e, f.name)
            if f.name == "records" and y is not None:
                assert len(x) == len(y)
                for t, (rx, ry) in enumerate(zip(x, y)):
                    for g in fields(StepRecord):
                        u, v = getattr(rx, g.name), getattr(ry, g.name)
                        assert (u is None) == (v is None), f"mg{m} step{t} {g.name}"
                        if v is not None:
                            assert_bitwise(u, v, f"mg{m} step{t} {g.name}")
            elif isinstance(y, torch.Tensor):
                assert_bitwise(x, y, f"mg{m} {f.name}")
            elif isinstance(y, dict):  # a branch's conditioning: the same names, each entry bitwise or both None
                assert x.keys() == y.keys(), f"mg{m} {f.name}"
                for k in y:
                    assert (x[k] is None) == (y[k] is None), f"mg{m} {f.name}.{k}"
                    if y[k] is not None:
                        assert_bitwise(x[k], y[k], f"mg{m} {f.name}.{k}")
            else:
                assert x == y and type(x) is type(y), f"mg{m} {f.name}: {x!r} != {y!r}"


def post_msgpack(url: str, path: str, body) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body if isinstance(body, bytes) else msgpack.packb(body),
                      headers={"content-type": MSGPACK}, timeout=60)


def checksums(url: str) -> dict:
    r = httpx.get(f"{url}/weights/checksum", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# -- health and rollouts ---------------------------------------------------------------------------------------
def test_health(url, tiny_checkpoint):
    health = httpx.get(f"{url}/health").json()
    assert health == {"status": "ok", "checkpoint": str(tiny_checkpoint), "family": "qwen_image", "patch_group": "none",
                      "disabled_patches": [], "patches_applied": [], "dtype": "bfloat16", "device": "cpu",
                      "threads": TEST_THREADS, "busy": False, "queue_depth": 0, "running_for_s": None,
                      "limits": {"max_steps": 100, "max_pixels": 2048 * 2048, "max_frames": 1,
                                 "max_prompt_tokens": 1024, "max_samples": 8, "max_queue": 16,
                                 "request_timeout": 3600.0}}


def test_rollout_round_trip_is_bitwise(url, reference):
    args = (["a red apple", "a cat"], 2, PARAMS, 7)
    served = remote_rollout(url, RolloutRequest(*args, record_snapshot=True))
    expected = reference.rollout(RolloutRequest(*args, record_snapshot=True))
    assert_same_rollout(served, expected)
    assert served.engine["lora_checksum"] == NO_LORA
    assert len(served.microgroups) == 4 and all(mg.records for mg in served.microgroups)
    # The codec alone, on a rollout with the optional parts absent (no CFG, no SDE step, no images).
    bare = reference.rollout(RolloutRequest(["x"], 1, SamplingParams(steps=2, sampler="ode", cfg_scale=1, height=32,
                                                                      width=32), 0, decode=False))
    assert bare.microgroups[0].negative_cond is None and bare.microgroups[0].guided_outputs.numel() == 0
    assert_same_rollout(wire.decode_rollout(wire.encode_rollout(bare)), bare)


def test_concurrent_rollouts_equal_their_sequential_results(url, reference):
    requests = [(["a cat"], 2, PARAMS, 1),
                (["a lighthouse at dusk"], 1, SamplingParams(steps=3, sampler="ode", height=32, width=48), 2)]
    with ThreadPoolExecutor(len(requests)) as pool:
        served = list(pool.map(lambda args: remote_rollout(url, RolloutRequest(*args)), requests))
    for args, out in zip(requests, served):
        assert_same_rollout(out, reference.rollout(RolloutRequest(*args)))
    assert httpx.get(f"{url}/health").json()["queue_depth"] == 0


def test_openai_images(url, reference):
    r = httpx.post(f"{url}/v1/images/generations", timeout=60, json={
        "model": "qwen-image", "prompt": "a cat", "n": 2, "size": "48x32", "response_format": "b64_json",
        "seed": 5, "steps": 2, "cfg_scale": 1.5, "sampler": "ode", "negative_prompt": "blurry"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["created"], int) and body["seed"] == 5 and len(body["data"]) == 2
    pngs = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in body["data"]]
    assert all(p.format == "PNG" and p.size == (48, 32) and p.mode == "RGB" for p in pngs)  # (width, height)
    expected = reference.rollout(RolloutRequest(["a cat"], 2, SamplingParams(steps=2, cfg_scale=1.5, sampler="ode",
                                                              negative_prompt="blurry", height=32, width=48), 5))
    for png, image in zip(pngs, expected.images):
        assert np.array_equal(np.asarray(png), image.numpy())  # PNG is lossless: the engine's pixels exactly


GOOD = {"prompts": ["a cat"], "n_per_prompt": 1, "seed": 0, "steps": 2, "height": 32, "width": 32}


@pytest.mark.parametrize("path, body, status, match", [
    ("/rollout/generate", b"\xc1 not msgpack", 400, "malformed msgpack body"),
    ("/rollout/generate", [1, 2], 400, "must be a map of fields"),
    ("/rollout/generate", {**GOOD, "temperature": 1.0}, 400, "unknown field.*'temperature'"),
    ("/rollout/generate", {"prompts": ["a cat"]}, 400, "missing field.*'n_per_prompt', 'seed'"),
    ("/rollout/generate", {**GOOD, "prompts": "a cat"}, 400, r"'prompts' must be list\[str\], got str"),
    ("/rollout/generate", {**GOOD, "steps": "2"}, 400, "'steps' must be int, got str"),
    ("/rollout/generate", {**GOOD, "n_per_prompt": True}, 400, "'n_per_prompt' must be int, got bool"),
    ("/rollout/generate", {**GOOD, "cfg_scale": math.nan}, 400, "'cfg_scale' must be a finite float"),
    ("/rollout/generate", {**GOOD, "sde_window": [0]}, 400, "'sde_window' must be tuple"),
    ("/rollout/generate", {**GOOD, "fps": 1e-30}, 400, r"fps must be in 1\.\.1000 frames a second, got 1e-30"),
    ("/rollout/generate", {**GOOD, "fps": 1e308}, 400, r"fps must be in 1\.\.1000 frames a second, got 1e\+308"),
    ("/rollout/generate", {**GOOD, "noise_level": 1e300}, 400, r"noise_level must be in 0\.\.100"),
    ("/rollout/generate", {**GOOD, "cfg_scale": 1e300}, 400, "cfg_scale must be at most 100"),
    ("/rollout/generate", {**GOOD, "seed": 2**63}, 400, "signed 64-bit"),
    ("/rollout/generate", {**GOOD, "sampler": "euler"}, 400, "unknown sampler 'euler'"),
    ("/rollout/generate", {**GOOD, "height": 40}, 400, "multiple of 16"),
    ("/rollout/generate", {**GOOD, "n_per_prompt": -2}, 400, "positive multiple"),
    ("/rollout/generate", {**GOOD, "prompts": []}, 400, "at least one prompt"),
    ("/rollout/generate", {**GOOD, "n_per_prompt": 3, "rollout_microgroup_size": 2}, 400, "multiple of rollout_micro"),
    ("/rollout/generate", {**GOOD, "n_per_prompt": 5, "prompts": ["a", "b"]}, 400, "10 samples.*at most 8"),
    ("/v1/images/generations", b"{not json", 400, "malformed JSON body"),
    ("/v1/images/generations", {"prompt": "a", "size": "big"}, 400, "WIDTHxHEIGHT"),
    ("/v1/images/generations", {"prompt": "a", "response_format": "url"}, 400, "b64_json"),
    ("/v1/images/generations", {"prompt": "a", "n": -1}, 400, "positive multiple"),
    # OpenAI's own fields are taken (tests/test_server_openai.py); any other unknown one is a typo, refused
    ("/v1/images/generations", {"prompt": "a", "quality_boost": "hd"}, 400, "unknown field.*'quality_boost'"),
    ("/v1/images/generations", {"prompt": "a", "cfg_scale": 1e300}, 400, "cfg_scale must be at most 100"),
    ("/weights/lora", {"path": "/nonexistent/lora.safetensors", "scale": 1.0}, 403,
     "off on this server.*--weights-root"),
    ("/weights/lora", {"path": "/nonexistent/lora.safetensors"}, 400, "missing field.*'scale'"),
    ("/weights/full", b"garbage", 415, "content-type must be"),
    ("/nowhere", b"", 404, "Not Found"),
])
def test_bad_requests_are_refused_and_the_server_keeps_serving(url, path, body, status, match):
    if path.startswith("/rollout") or isinstance(body, bytes) and path.startswith("/weights"):
        r = post_msgpack(url, path, body)
    elif isinstance(body, bytes):
        r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(f"{url}{path}", json=body)
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"]
    error = r.json()["error"]
    if path.startswith("/v1/"):  # OpenAI's error object, which its SDKs show
        assert list(error) == ["message", "type", "param", "code"] and error["type"] == "invalid_request_error"
        error = error["message"]
    assert re.search(match, error), error
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


# -- weight updates --------------------------------------------------------------------------------------------
def test_lora_update_by_file_and_by_ipc(fresh_url, reference, tiny_checkpoint, tmp_path):
    base = checksums(fresh_url)
    assert base["lora"] == NO_LORA
    lora = make_lora(0)
    save_file(lora, str(tmp_path / "lora.safetensors"))
    r = httpx.post(f"{fresh_url}/weights/lora", json={"path": str(tmp_path / "lora.safetensors"), "scale": 0.5},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"lora": tensors_checksum(lora)}
    after_file = checksums(fresh_url)
    assert after_file["lora"] == tensors_checksum(lora) and after_file["weights"] != base["weights"]

    other = make_lora(10)
    assert push_lora(fresh_url, other, scale=1.0, merge_mode="unmerged") == tensors_checksum(other)
    assert checksums(fresh_url)["lora"] == tensors_checksum(other)

    # The update is what the engine runs with: the same rollout as an in-process engine given the same LoRA.
    ref = Engine(tiny_checkpoint)
    ref.update_weights(other, lora_scale=1.0, merge_mode="unmerged")
    args = (["a cat"], 1, PARAMS, 3)
    served = remote_rollout(fresh_url, RolloutRequest(*args))
    assert_same_rollout(served, ref.rollout(RolloutRequest(*args)))
    assert served.engine["lora_checksum"] == tensors_checksum(other)
    without = reference.rollout(RolloutRequest(*args))
    assert_differs(served.microgroups[0].latents, without.microgroups[0].latents, "LoRA vs base")

    # Full weights by path (a checkpoint folder) drop the LoRA: back to the base checksum.
    r = httpx.post(f"{fresh_url}/weights/full", json={"path": str(tiny_checkpoint)}, timeout=60)
    assert r.status_code == 200 and r.json() == {"weights": base["weights"]}, r.text
    assert checksums(fresh_url) == base


def test_failed_updates_leave_the_weights_unchanged(fresh_url, tiny_checkpoint, tmp_path):
    assert push_lora(fresh_url, make_lora(0), scale=1.0) == tensors_checksum(make_lora(0))
    before = checksums(fresh_url)
    a, b = "transformer_blocks.0.attn.to_q.lora_A.weight", "transformer_blocks.0.attn.to_q.lora_B.weight"
    nan, inf = make_lora(1), make_lora(1)
    nan[b][0, 0], inf[a][1, 2] = math.nan, math.inf
    bad = {
        "wrong shape": ({**make_lora(1), a: randn((4, 63), 0)}, "wrong shape"),
        "NaN": (nan, "NaN or inf values in 1 tensor.*lora_B"),
        "inf": (inf, "NaN or inf values in 1 tensor.*lora_A"),
        "unknown module": ({**make_lora(1), "transformer_blocks.9.attn.to_q.lora_A.weight": randn((4, 64), 0),
                            "transformer_blocks.9.attn.to_q.lora_B.weight": randn((64, 4), 1)}, "unexpected"),
        "A without B": ({a: make_lora(1)[a]}, "missing"),
        "integer": ({**make_lora(1), a: torch.ones(4, 64, dtype=torch.int16)}, "not floating point"),
    }
    for what, (state, match) in bad.items():
        save_file(state, str(tmp_path / "bad.safetensors"))
        r = httpx.post(f"{fresh_url}/weights/lora", json={"path": str(tmp_path / "bad.safetensors"), "scale": 1.0})
        assert r.status_code == 400 and re.search(match, r.json()["error"]), (what, r.text)
        with pytest.raises(ServerError, match=match) as e:
            push_lora(fresh_url, state, scale=1.0)
        assert e.value.status == 400, what
        assert checksums(fresh_url) == before, what
    with pytest.raises(ServerError, match="unknown LoRA merge mode 'fused'"):
        push_lora(fresh_url, make_lora(1), scale=1.0, merge_mode="fused")
    full = read_transformer_state_dict(tiny_checkpoint)
    for what, broken, match in [("NaN", {**full, "proj_out.bias": full["proj_out.bias"] * math.nan}, "NaN"),
                                ("shape", {**full, "proj_out.bias": full["proj_out.bias"][:-1]}, "wrong shape")]:
        with pytest.raises(ServerError, match=match):
            push_weights(fresh_url, broken)
        assert checksums(fresh_url) == before, what
    r = httpx.post(f"{fresh_url}/weights/lora", content=b"\x80\x04garbage",
                   headers={"content-type": wire.IPC_CONTENT_TYPE})
    assert r.status_code == 400 and "malformed IPC payload" in r.json()["error"]
    assert checksums(fresh_url) == before


def test_ipc_payloads_run_no_foreign_code(fresh_url, tmp_path):
    """An IPC payload is msgpack, never unpickled: a pickle that would run a command is refused as no payload."""
    import pickle

    owned = tmp_path / "owned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {owned}",))

    r = httpx.post(f"{fresh_url}/weights/lora", content=pickle.dumps({"buckets": [], "scale": Evil()}),
                   headers={"content-type": wire.IPC_CONTENT_TYPE})
    assert r.status_code == 400 and "not a trueflow-ipc/1 payload" in r.json()["error"], r.text
    assert not owned.exists()


def test_ipc_handles_are_taken_from_loopback_clients_only(reference):
    from fastapi.testclient import TestClient

    with TestClient(create_app(reference)) as client:  # its requests come from the host "testclient"
        r = client.post("/weights/lora", content=wire.dump_handles([], SharedSegments(), scale=1.0),
                        headers={"content-type": wire.IPC_CONTENT_TYPE})
    assert r.status_code == 403 and "loopback clients only" in r.json()["error"]


def test_an_update_never_lands_inside_a_rollout(fresh_url, reference):
    args = (["a cat", "a dog"], 2, PARAMS, 11)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=remote_rollout(fresh_url, RolloutRequest(*args))))
    thread.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{fresh_url}/health").json()["queue_depth"] == 0:  # the rollout is queued or running
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.005)
    assert push_lora(fresh_url, make_lora(0), scale=1.0) == tensors_checksum(make_lora(0))
    thread.join(60)
    assert not thread.is_alive()  # the push answered after the rollout: one worker, in arrival order
    assert result["out"].engine["lora_checksum"] == NO_LORA
    assert_same_rollout(result["out"], reference.rollout(RolloutRequest(*args)))  # every step ran with the old weights


# -- the command line, in another process: IPC handles really cross a process boundary --------------------------
@contextlib.contextmanager
def serve_subprocess(checkpoint, *flags: str):
    with socket.socket() as s:  # a free port for the subprocess (a race with other processes is unlikely)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(TRUEFLOW_EXE), "serve", "--checkpoint", str(checkpoint), "--port", str(port),
                             "--threads", str(TEST_THREADS), *flags],
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "trueflow serve did not answer within 60 s"
            try:
                httpx.get(f"{url}/health", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_cli_weight_updates_across_processes(tiny_checkpoint, reference):
    with serve_subprocess(tiny_checkpoint, "--max-samples", "4", "--patch-group", "none") as (url, _proc):
        health = httpx.get(f"{url}/health").json()
        assert (health["threads"], health["limits"]["max_samples"], health["patch_group"]) == (TEST_THREADS, 4, "none")
        base = checksums(url)
        assert base == {"weights": reference.weights_checksum(), "lora": NO_LORA}
        lora = make_lora(0)
        assert push_lora(url, lora, scale=1.0) == tensors_checksum(lora) == checksums(url)["lora"]
        nan = {k: v * math.nan for k, v in lora.items()}
        with pytest.raises(ServerError, match="NaN or inf"):
            push_lora(url, nan, scale=1.0)
        assert checksums(url)["lora"] == tensors_checksum(lora)
        full = {k: v.to(BF16) for k, v in read_transformer_state_dict(tiny_checkpoint).items()}
        assert push_weights(url, full, bucket_bytes=64 << 10) == base["weights"]  # several buckets
        assert checksums(url) == base
