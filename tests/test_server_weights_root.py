"""Weight updates by path read only under `--weights-root`: relative or absolute paths inside it load; `..`,
absolute paths and links out of it are refused with one message whether the target exists or not; a file that
is no safetensors is refused without a byte of it in the answer; every refusal leaves the weights as they were."""

from __future__ import annotations

import json
import os
import shutil
import struct

import httpx
import pytest
from safetensors.torch import save_file

from conftest import randn
from trueflow.engine.engine import Engine
from trueflow.server import create_app
from trueflow.http import serve_in_thread
from trueflow.sync.checksum import tensors_checksum

SECRET = "SECRET-7f3a9c"


def make_lora(seed: int) -> dict:
    return {"transformer_blocks.0.attn.to_q.lora_A.weight": randn((4, 64), seed, std=0.1),
            "transformer_blocks.0.attn.to_q.lora_B.weight": randn((64, 4), seed + 1, std=0.1)}


@pytest.fixture
def tree(tmp_path, tiny_checkpoint):
    """root/ (the weights root) with a LoRA, a checkpoint copy and bad entries; outside/ next to it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    save_file(make_lora(0), str(root / "lora.safetensors"))
    save_file(make_lora(5), str(outside / "lora.safetensors"))
    (outside / "passwd").write_text(f"root:x:0:0:{SECRET}:/root:/bin/bash\n")
    os.symlink(outside / "lora.safetensors", root / "link.safetensors")
    os.symlink(outside, root / "linked_dir")
    shutil.copytree(tiny_checkpoint / "transformer", root / "ckpt" / "transformer")
    # A sharded checkpoint whose index names a shard outside the root.
    sharded = root / "sharded" / "transformer"
    sharded.mkdir(parents=True)
    shutil.copy(tiny_checkpoint / "transformer" / "config.json", sharded)
    (sharded / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../../../outside/lora.safetensors"}}))
    # Safetensors headers whose text the parser would quote in its error.
    header = json.dumps({"w": {"dtype": SECRET, "shape": [1], "data_offsets": [0, 4]}}).encode()
    (root / "crafted.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    header = f'{{"{SECRET}": 1, not json'.encode()
    (root / "crafted2.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return root, outside


@pytest.fixture
def url(tree, tiny_checkpoint):
    with serve_in_thread(create_app(Engine(tiny_checkpoint), weights_root=tree[0])) as url:
        yield url


def load(url: str, path: str, full: bool = False) -> httpx.Response:
    if full:
        return httpx.post(f"{url}/weights/full", json={"path": path}, timeout=60)
    return httpx.post(f"{url}/weights/lora", json={"path": path, "scale": 1.0}, timeout=60)


def checksums(url: str) -> dict:
    return httpx.get(f"{url}/weights/checksum", timeout=60).json()


def test_paths_inside_the_root_load(url, tree):
    root, _ = tree
    for path in ["lora.safetensors", str(root / "lora.safetensors"), "ckpt/../lora.safetensors"]:
        r = load(url, path)
        assert r.status_code == 200 and r.json() == {"lora": tensors_checksum(make_lora(0))}, (path, r.text)
    before = checksums(url)
    r = load(url, "ckpt", full=True)
    assert r.status_code == 200, r.text
    assert checksums(url)["lora"] != before["lora"]  # a full update drops the LoRA


def test_paths_out_of_the_root_are_refused_alike(url, tree):
    root, outside = tree
    assert load(url, "lora.safetensors").status_code == 200
    before = checksums(url)
    cases = {  # path -> does its target exist
        "../outside/lora.safetensors": True, "../outside/missing.safetensors": False,
        str(outside / "lora.safetensors"): True, str(outside / "missing.safetensors"): False,
        "/etc/passwd": True, "/etc/no-such-file": False, "../outside/passwd": True,
        "link.safetensors": True, "linked_dir/lora.safetensors": True, "linked_dir/missing": False,
        "a\x00b": False,
    }
    messages = set()
    for path in cases:
        for full in (False, True):
            r = load(url, path, full)
            assert r.status_code == 403, (path, r.text)
            message = r.json()["error"].replace(repr(path), "PATH")  # the client's own path aside, nothing
            assert "--weights-root" in message and str(root) not in message and str(tree[0].parent) not in message
            messages.add(message)
    assert len(messages) == 1, messages  # existence outside the root changes nothing in the answer
    r = load(url, "sharded", full=True)  # inside, but its index points out
    assert r.status_code == 403 and "--weights-root" in r.json()["error"], r.text
    assert checksums(url) == before


def test_file_content_is_never_echoed(url):
    assert load(url, "lora.safetensors").status_code == 200
    before = checksums(url)
    for path in ["crafted.safetensors", "crafted2.safetensors", "crafted.safetensors/"]:
        for full in (False, True):
            r = load(url, path, full)
            assert r.status_code == 400, (path, r.text)
            assert SECRET not in r.text and "cannot read weights from" in r.json()["error"], r.text
    r = load(url, "missing.safetensors")
    assert r.status_code == 400 and "nothing at 'missing.safetensors'" in r.json()["error"]
    assert checksums(url) == before
