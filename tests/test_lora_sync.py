"""LoRA sync: an unmerged update of the same shapes copies into the installed adapters (so captured CUDA graphs
stay valid) and computes what a fresh engine with that LoRA computes; the sync checksum is the documented
position-weighted wrapping sum (checked against a numpy transcription of the formula), catches a flipped bit and
two swapped tensors, and is the same on CPU and CUDA."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import BF16, assert_bitwise, randn
from trueflow.engine.weights import build_engine_transformer
from trueflow.models.lora import update_lora
from trueflow.layers.linear import Linear
from trueflow.sync import checksum
from trueflow.sync.buckets import Bucket, pack
from trueflow.sync.checksum import buckets_checksum, tensors_checksum

TARGETS = {"attn.to_q": (1, 1), "attn.add_v_proj": (1, 1), "img_mlp.net.0.proj": (1, 4), "txt_mlp.net.2": (4, 1)}


def parity_engine(tiny) -> torch.nn.Module:
    return build_engine_transformer(tiny[0], tiny[1], "cpu", BF16, "qwen_image")  # keeps LoRA unmerged


def peft_lora(config: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    out = {}
    for i in range(config["num_layers"]):
        for j, (name, (d_in, d_out)) in enumerate(TARGETS.items()):
            prefix = f"transformer_blocks.{i}.{name}"
            out[f"{prefix}.lora_A.weight"] = randn((rank, d_in * inner), seed + 100 * i + 2 * j, std=0.1)
            out[f"{prefix}.lora_B.weight"] = randn((d_out * inner, rank), seed + 100 * i + 2 * j + 1, std=0.1)
    return out


def adapter_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in model.modules() if isinstance(m, Linear) for a in m.adapters if a for t in (a.A, a.B)]


@torch.no_grad()
def forward(model: torch.nn.Module, config: dict) -> torch.Tensor:
    side, text = 4, 7
    hs = randn((2, side * side, config["in_channels"]), 0)
    ehs = randn((2, text, config["joint_attention_dim"]), 1)
    return model(hs, ehs, torch.tensor([731.25]).expand(2), (side, side))


def test_same_shape_update_copies_in_place_and_equals_a_fresh_engine(tiny):
    config = tiny[0]
    model = parity_engine(tiny)
    update_lora(model, peft_lora(config, 4, seed=0), scale=0.5)  # first install: new tensors
    held = adapter_tensors(model)
    ptrs = [t.data_ptr() for t in held]
    update_lora(model, peft_lora(config, 4, seed=1), scale=0.5)
    assert [t.data_ptr() for t in adapter_tensors(model)] == ptrs, "a same-shape update allocated new adapters"
    assert all(a is b for a, b in zip(adapter_tensors(model), held))
    fresh = parity_engine(tiny)
    update_lora(fresh, peft_lora(config, 4, seed=1), scale=0.5)
    out = forward(model, config)
    assert_bitwise(out, forward(fresh, config), "in-place update vs a fresh engine")
    assert not torch.equal(out, forward(parity_engine(tiny), config)), "the LoRA changed nothing"

    # another rank or another scale installs new tensors, and still equals a fresh engine
    for rank, scale in ((8, 0.5), (8, 0.25)):
        before = [t.data_ptr() for t in adapter_tensors(model)]
        update_lora(model, peft_lora(config, rank, seed=2), scale=scale)
        assert [t.data_ptr() for t in adapter_tensors(model)] != before, (rank, scale)
        fresh = parity_engine(tiny)
        update_lora(fresh, peft_lora(config, rank, seed=2), scale=scale)
        assert_bitwise(forward(model, config), forward(fresh, config), f"rank {rank} scale {scale}")


def test_refused_update_leaves_in_place_adapters_unchanged(tiny):
    model = parity_engine(tiny)
    update_lora(model, peft_lora(tiny[0], 4, seed=0), scale=1.0)
    before = [t.clone() for t in adapter_tensors(model)]
    bad = peft_lora(tiny[0], 4, seed=1)
    name = sorted(bad)[-1]  # the last tensor: every other one would be valid
    bad[name] = bad[name].clone()
    bad[name].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="nothing was applied"):
        update_lora(model, bad, scale=1.0)
    assert all(torch.equal(a, b) for a, b in zip(adapter_tensors(model), before))


# -- the checksum ----------------------------------------------------------------------------------------------
def reference_checksum(tensors: dict[str, torch.Tensor], extra: str = "") -> str:
    """The module docstring's formula in numpy: name-ordered bytes, each tensor zero-padded to 16 bytes, as
    little-endian int32 words w at position p; sum of w·u·v mod 2^64 with u = 2·((p // 4096)·48271 mod (2^31-1))+1
    and v = 2·((p mod 4096)·40503 mod 65521)+1."""
    names = sorted(tensors)
    blob = b"".join(b + bytes(-len(b) % 16) for b in
                    (tensors[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n in names))
    words = np.frombuffer(blob, dtype="<i4").astype(np.int64)
    p = np.arange(words.size, dtype=np.int64)
    u = 2 * ((p // 4096) * 48271 % (2**31 - 1)) + 1
    v = 2 * ((p % 4096) * 40503 % 65521) + 1
    with np.errstate(over="ignore"):
        total = int((words.astype(np.uint64) * u.astype(np.uint64) * v.astype(np.uint64)).sum(dtype=np.uint64))
    text = "".join(f"{n}|{tensors[n].dtype}|{tuple(tensors[n].shape)}\n" for n in names) + f"sum|{total}\n" + extra
    return hashlib.sha256(text.encode()).hexdigest()


def mixed_tensors() -> dict[str, torch.Tensor]:
    """Several rows of 4096 words, odd byte lengths (padding), fp32 and bf16, a 0-d tensor."""
    return {"b.lora_A.weight": randn((8, 1001), 1), "b.lora_B.weight": randn((999, 8), 2),
            "a.weight": randn((3, 5), 3, dtype=torch.float32), "c.scale": torch.tensor(0.5),
            "d.big": randn((7, 4096), 4), "e.odd": randn((13,), 5)}


def test_checksum_is_the_documented_formula(monkeypatch):
    tensors = mixed_tensors()
    expected = reference_checksum(tensors, "x")
    assert tensors_checksum(tensors, "x") == expected
    monkeypatch.setattr(checksum, "_GROUP_BYTES", 4096)  # many groups, each starting mid-row
    assert tensors_checksum(tensors, "x") == expected
    assert tensors_checksum({}, "x") == hashlib.sha256(b"x").hexdigest()


def test_checksum_of_the_sent_buckets_is_the_tensors_checksum(monkeypatch):
    """The sender's side, read off `pack`'s buffers (several buckets), equals the formula; so does a bucket whose
    layout is not pack's (reversed manifest: the fallback through the tensors)."""
    tensors = mixed_tensors()
    expected = reference_checksum(tensors, "x")
    buckets = pack(tensors, max_bytes=20000)
    assert len(buckets) > 2
    assert buckets_checksum(buckets, "x") == expected
    monkeypatch.setattr(checksum, "_GROUP_BYTES", 4096)
    assert buckets_checksum(buckets, "x") == expected
    reordered = [Bucket(b.buffer, b.manifest[::-1]) for b in buckets]
    assert buckets_checksum(reordered, "x") == expected


def test_checksum_sees_a_flipped_bit_and_swapped_tensors():
    tensors = mixed_tensors()
    base = tensors_checksum(tensors)
    for name in tensors:
        for index, bit in ((0, 0), (-1, 15)):  # the lowest and highest bit of a 16-bit word
            flipped = tensors[name].clone()
            flipped.reshape(-1).view(torch.int16)[index] ^= (1 << bit) if bit < 15 else -(1 << 15)  # int16's sign bit
            assert tensors_checksum({**tensors, name: flipped}) != base, (name, index, bit)
    # two same-shape tensors swapped, one a permutation of the other (their plain sums agree)
    a = randn((64, 128), 7)
    b = a.flatten().flip(0).reshape(a.shape)
    first = tensors_checksum({"x": a, "y": b})
    assert tensors_checksum({"x": b, "y": a}) != first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checksum_is_the_same_on_cpu_and_cuda():
    tensors = mixed_tensors()
    assert tensors_checksum({k: v.cuda() for k, v in tensors.items()}) == tensors_checksum(tensors)
    half = {k: (v.cuda() if i % 2 else v) for i, (k, v) in enumerate(sorted(tensors.items()))}
    assert tensors_checksum(half) == tensors_checksum(tensors)  # mixed devices


# -- the benchmark's CPU smoke run -----------------------------------------------------------------------------
def test_weight_sync_benchmark_smoke_run(tmp_path):
    """`benchmarks/weight_sync.py --size tiny`: every row confirmed by the engine's checksum, with min <= median
    <= max; a bad --rows is one line and exit 2."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "sync.json"
    cmd = [sys.executable, str(root / "benchmarks" / "weight_sync.py"), "--size", "tiny", "--rank", "4",
           "--repeats", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", "lora_unmerged", "lora_merged"}
    for r in rows.values():
        assert r["checksum_ok"] is True and r["repeats"] == len(r["totals_s"]) == 2
        assert r["min_total_s"] <= r["total_s"] <= r["max_total_s"]
    assert rows["lora_unmerged"]["engine_checksum_s"] is not None and rows["lora_unmerged"]["pack_s"] is not None
    bad = subprocess.run(cmd[:-2] + ["--rows", "lora", "--out", str(out)], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--rows 'lora'" in bad.stdout and "Traceback" not in bad.stderr
