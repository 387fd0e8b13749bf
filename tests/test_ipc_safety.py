"""IPC weight updates touch only memory their sender made for them (docs/server.md, "Trust"): payloads that name a
victim file under /dev/shm — torch's own file_system handles (the refcount protocol that decremented and unlinked it,
and grew it), a stride-0 tensor, trueflow payloads naming it, a look-alike segment of the wrong mode, size or nonce,
a CUDA handle whose refcount file is the victim — are refused with a 400 and the victim keeps its bytes, its size and
its name; the sender's segments are unlinked when it is done and when it is killed; the weights token."""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import torch
from fastapi.testclient import TestClient
from torch.multiprocessing.reductions import rebuild_storage_filename, rebuild_tensor

from trueflow.engine import wire
from trueflow.engine.engine import Engine
from trueflow.http import serve_in_thread
from trueflow.placement.http import push_lora
from trueflow.server import create_app
from trueflow.server.weights import TOKEN_ENV, weights_token
from trueflow.sync import shm
from trueflow.sync.buckets import pack
from trueflow.sync.checksum import tensors_checksum

from test_server import NO_LORA, checksums, make_lora

A = "transformer_blocks.0.attn.to_q.lora_A.weight"
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def url(tiny_checkpoint):
    with serve_in_thread(create_app(Engine(tiny_checkpoint))) as url:
        yield url


@pytest.fixture
def victim():
    """A 4 KiB file under /dev/shm whose first int32 is 1 (torch's decref would take it to 0 and unlink it)."""
    path = SHM / f"victim-{secrets.token_hex(6)}"
    data = (1).to_bytes(4, "little") + secrets.token_bytes(4092)
    path.write_bytes(data)
    yield path, data
    path.unlink(missing_ok=True)


def look_alike(mode: int, size: int, header: bytes = b"") -> Path:
    """A file with a trueflow segment's name, made by someone else (this test)."""
    path = SHM / f"trueflow-victim{secrets.token_hex(4)}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.fchmod(fd, mode)
    os.write(fd, header.ljust(size, b"\x01"))
    os.close(fd)
    return path


def ipc_payload(*buckets: dict, **fields) -> bytes:
    return msgpack.packb({"format": wire.IPC_FORMAT, "buckets": list(buckets), "fields": {"scale": 1.0, **fields}})


def shm_bucket(name: str, size: int = 512, nonce: bytes = bytes(32)) -> dict:
    return {"manifest": [[A, "bfloat16", [4, 64], 0]], "size": size, "shm": name, "nonce": nonce}


def cuda_bucket(ref_counter: bytes = b"/torch_1_2_3", size: int = 512) -> dict:
    """A CUDA bucket of the form torch's reduction gives (its handle made up)."""
    return {"manifest": [[A, "bfloat16", [4, 64], 0]], "size": size, "cuda": {
        "device": 0, "handle": bytes(64), "storage_bytes": size, "storage_offset": 0, "tensor_offset": 0,
        "ref_counter": ref_counter, "ref_counter_offset": 0, "event": bytes(64), "event_sync_required": True}}


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def torch_file_system_payload(name: str, stride0: bool = False) -> bytes:
    """What the old route took: torch's file_system handle of `name`, grown to 64 MiB (a 1-D view, or stride 0)."""
    storage = _Reduce(rebuild_storage_filename, torch.UntypedStorage, b"/nonexistent/manager.sock", name.encode(),
                      64 << 20)
    tensor = _Reduce(rebuild_tensor, torch.Tensor, storage, (0, (64 << 20,), (0 if stride0 else 1,), False))
    return pickle.dumps({"buckets": [(tensor, [(A, torch.bfloat16, (4, 64), 0)])], "scale": 1.0})


def post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/weights/lora", content=body, headers={"content-type": wire.IPC_CONTENT_TYPE},
                      timeout=60)


CASES = {  # what the payload is -> (payload of the victim's /dev/shm name, what the refusal says)
    "torch file_system handle": (lambda v: torch_file_system_payload(f"/{v.name}"), "not a trueflow-ipc/1 payload"),
    "stride-0 torch tensor": (lambda v: torch_file_system_payload(f"/{v.name}", True), "not a trueflow-ipc/1 payload"),
    "segment name": (lambda v: ipc_payload(shm_bucket(f"/{v.name}")), "not the name of a trueflow shared-memory"),
    "escaping name": (lambda v: ipc_payload(shm_bucket(f"/trueflow-a-{'0' * 16}/../../{v.name}")), "not the name"),
    "CUDA refcount file": (lambda v: ipc_payload(cuda_bucket(f"/{v.name}".encode())), "a CUDA IPC handle has"),
    "bucket past its size": (lambda v: ipc_payload({**shm_bucket(f"/{v.name}", size=100)}), "does not lie aligned"),
    "misaligned entry": (lambda v: ipc_payload({**shm_bucket(f"/{v.name}"), "manifest": [[A, "bfloat16", [4], 1]]}),
                         "does not lie aligned"),
    "negative size": (lambda v: ipc_payload({**shm_bucket(f"/{v.name}"), "size": -1}), "is not a byte count"),
    "fields as a list": (lambda v: msgpack.packb({"format": wire.IPC_FORMAT, "buckets": [], "fields": [1]}),
                         "expected a map"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_payload_naming_a_victim_file_is_refused_and_the_file_keeps_its_bytes(url, victim, case):
    path, data = victim
    make, says = CASES[case]
    r = post(url, make(path))
    assert r.status_code == 400 and says in r.json()["error"], r.text
    assert path.exists() and path.stat().st_size == len(data) and path.read_bytes() == data
    assert checksums(url)["lora"] == NO_LORA


@pytest.mark.parametrize("mode, size, nonce, says", [
    (0o644, 512 + shm.HEADER, bytes(32), "open to other users"),
    (0o600, 4096, bytes(32), "4096 bytes, not the 576 its payload declares"),
    (0o600, 512 + shm.HEADER, secrets.token_bytes(32), "another update's nonce"),
], ids=["open to other users", "another size", "another nonce"])  # fixed ids: the same tests on every xdist worker
def test_a_look_alike_segment_is_refused_untouched(url, mode, size, nonce, says):
    """A file named like a trueflow segment but made by someone else: its mode, its size (never grown to the one
    declared) or its header (another nonce) gives it away."""
    path = look_alike(mode, size, shm._header(512, bytes(32)))
    try:
        data = path.read_bytes()
        r = post(url, ipc_payload(shm_bucket(f"/{path.name}", 512, nonce)))
        assert r.status_code == 400 and says in r.json()["error"], r.text
        assert path.read_bytes() == data and path.stat().st_size == size
    finally:
        path.unlink()
    assert checksums(url)["lora"] == NO_LORA


def test_a_cuda_refcount_file_torch_did_not_make_is_never_opened(url):
    """A CUDA handle's refcount file of torch's name pattern, but not the size of torch's counters: refused before
    torch would map (and grow) it; one of the right form gets no further than the handle (no CUDA here)."""
    for size, says in [(4096, "is not one torch made"), (wire.CUDA_REF_FILE_BYTES, "cannot open the CUDA IPC handle")]:
        name = f"torch_{os.getpid()}_{secrets.randbelow(10**9)}_0"
        path = SHM / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, (1).to_bytes(4, "little").ljust(size, b"\0"))
        os.close(fd)
        try:
            data = path.read_bytes()
            r = post(url, ipc_payload(cuda_bucket(f"/{name}".encode())))
            assert r.status_code == 400 and says in r.json()["error"], r.text
            assert path.read_bytes() == data
        finally:
            path.unlink()


def trueflow_segments() -> set[str]:
    """The segments named for this process (a sender's default tag, `trueflow-p<pid>-`): other processes, a second
    test worker's included, make and unlink theirs meanwhile."""
    return {p.name for p in SHM.glob(f"trueflow-p{os.getpid()}-*")}


def test_the_sender_unlinks_its_segments(url):
    """An update's segments are the sender's: 0600, named for this process, and gone once the server answered (a
    one-off push) or the packer's buffers are dropped; `unlink_run` removes a run's leftovers by its tag."""
    before = trueflow_segments()
    lora = make_lora(0)
    assert push_lora(url, lora, 1.0) == tensors_checksum(lora)
    assert trueflow_segments() == before
    segments = shm.SharedSegments()
    buckets = pack(lora, allocate=segments.allocate)
    made = trueflow_segments() - before
    assert len(made) == 1, made  # one segment, named for this process (one of another name is not in the set)
    assert (SHM / next(iter(made))).stat().st_mode & 0o777 == 0o600
    payload = wire.dump_handles(buckets, segments, scale=1.0)
    opened, fields = wire.load_handles(payload)
    assert torch.equal(opened[0].buffer, buckets[0].buffer) and fields == {"scale": 1.0}
    wire.dump_handles(buckets, segments, scale=1.0)  # the next update's nonce replaces this one's
    with pytest.raises(ValueError, match="another update's nonce"):
        wire.load_handles(payload)
    del buckets, opened
    segments.allocate(16, "cpu")  # prunes the segment whose buffers are gone
    assert len(trueflow_segments() - before) == 1
    segments.close()
    assert trueflow_segments() == before
    with pytest.raises(ValueError, match="from a segment of its sender"):
        wire.dump_handles(pack(lora), segments)


KILLED_SENDER = """
import sys
from trueflow.sync.shm import SharedSegments
s = SharedSegments()
b = s.allocate(4096, "cpu")
print(s.describe(b)["shm"], flush=True)
sys.stdin.read()
"""


def test_a_killed_sender_leaves_no_segment(tmp_path):
    """SIGKILL skips every exit handler: the resource tracker unlinks the segment; a run's driver unlinks what is
    left under its tag."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, shm.TAG_ENV: "killedsender"})
    name = proc.stdout.readline().strip()
    assert name.startswith("/trueflow-killedsender-") and (SHM / name[1:]).exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while (SHM / name[1:]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (SHM / name[1:]).exists()
    left = look_alike(0o600, 64)
    tag = left.name.split("-")[1]
    assert shm.unlink_run(tag) == [f"/{left.name}"] and not left.exists()


def test_the_weights_routes_take_the_token(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert weights_token("127.0.0.1") is None and weights_token("::1") is None
    made = weights_token("0.0.0.0")
    assert made and len(made) >= 40 and made != weights_token("0.0.0.0")
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    assert weights_token("127.0.0.1") == weights_token("0.0.0.0") == "s3cret"
    with TestClient(create_app(Engine(tiny_checkpoint), token="s3cret")) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = client.get("/weights/checksum", headers=headers)
            assert r.status_code == 401 and TOKEN_ENV in r.json()["error"], r.text
            assert client.post("/weights/lora", json={"path": "x", "scale": 1.0}, headers=headers).status_code == 401
        assert client.get("/weights/checksum", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200  # the other routes take no token
