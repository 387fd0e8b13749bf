"""The engine's LoRA arena (`engine/lora_arena.py`): after a first install from buckets, an update of the same
layout is checked off the incoming buffers and copied, one copy per bucket, into the storage the adapters already
view (their addresses unchanged, so captured CUDA graphs stay valid). It computes exactly what the general path
computes, its checksum is the general path's, and every value the general path refuses is refused too, through the
general path's own error, with nothing installed. The sender's `BucketPacker` refills its buffers in place."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import BF16, assert_bitwise
from test_lora_sync import adapter_tensors, forward, parity_engine, peft_lora
from trueflow.engine import lora_arena
from trueflow.engine.lora_arena import lora_checksum, update_lora_packed
from trueflow.models.lora import lora_state, update_lora
from trueflow.sync.buckets import BucketPacker, pack
from trueflow.sync.checksum import tensors_checksum

RANK = 4


@pytest.fixture
def general_calls(monkeypatch) -> list:
    """Counts the general path's installs made on the way through `update_lora_packed`."""
    calls = []
    real = lora_arena.lora.update_lora

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_arena.lora, "update_lora", counted)
    return calls


def lora(tiny, seed: int, rank: int = RANK) -> dict[str, torch.Tensor]:
    return {k: v.to(BF16) for k, v in peft_lora(tiny[0], rank, seed).items()}


def test_same_layout_update_is_one_copy_into_the_adapters_and_equals_the_general_path(tiny, general_calls):
    model = parity_engine(tiny)
    update_lora_packed(model, pack(lora(tiny, 0)), 0.5)  # first install: the general path, then the arena
    assert len(general_calls) == 1 and model.lora_arena is not None
    ptrs = [t.data_ptr() for t in adapter_tensors(model)]
    storages = {b.buffer.untyped_storage().data_ptr() for b in model.lora_arena.buckets}
    assert all(t.untyped_storage().data_ptr() in storages for t in adapter_tensors(model)), "adapters outside the arena"
    for seed in (1, 2):
        update_lora_packed(model, pack(lora(tiny, seed)), 0.5)
        assert len(general_calls) == 1, "a same-layout update left the fast path"
        assert [t.data_ptr() for t in adapter_tensors(model)] == ptrs, "the adapters moved"
    general = parity_engine(tiny)
    update_lora(general, lora(tiny, 2), 0.5)
    assert_bitwise(forward(model, tiny[0]), forward(general, tiny[0]), "arena update vs the general path")
    assert lora_checksum(model) == tensors_checksum(lora_state(general)) == tensors_checksum(lora(tiny, 2))
    assert lora_checksum(model) != tensors_checksum(lora(tiny, 1)), "the checksum did not follow the update"


def bad_values(tiny) -> dict[str, tuple[dict[str, torch.Tensor], str]]:
    """Same layout as `lora(tiny, ·)` (bf16, same shapes): what -> (update, words of the general path's error)."""
    good = lora(tiny, 3)
    a, b = sorted(good)[0], sorted(good)[1]  # one module's A and B
    module = a.removesuffix(".lora_A.weight")

    def at(name: str, value: float) -> dict[str, torch.Tensor]:
        t = good[name].clone()
        t.view(-1)[-1] = value
        return {name: t}

    return {"NaN": ({**good, **at(a, math.nan)}, f"{a} holds NaN"),
            "inf": ({**good, **at(b, math.inf)}, f"{b} holds inf"),
            # 2e19 each, finite in bf16, as is scale·B; their product, the merged weight, is not
            "merged weight overflows": ({**good, **at(a, 2e19), **at(b, 2e19)},
                                        f"{module}: the merged weight W + scale·B·A may reach")}


@pytest.mark.parametrize("what", ["NaN", "inf", "merged weight overflows"])
def test_fast_check_refuses_what_the_general_path_refuses(tiny, general_calls, what):
    model = parity_engine(tiny)
    update_lora_packed(model, pack(lora(tiny, 0)), 1.0)
    update_lora_packed(model, pack(lora(tiny, 1)), 1.0)
    before = [t.clone() for t in adapter_tensors(model)]
    update, reason = bad_values(tiny)[what]
    with pytest.raises(ValueError, match="nothing was applied") as info:
        update_lora_packed(model, pack(update), 1.0)
    assert reason in str(info.value)
    assert all(torch.equal(x, y) for x, y in zip(adapter_tensors(model), before)), "a refused update changed the LoRA"
    assert lora_checksum(model) == tensors_checksum(lora(tiny, 1))


def test_scale_times_b_overflow_is_refused_on_the_fast_path(tiny, general_calls):
    """1e30 and 1e10 are finite in bf16, their product is not: an engine folding the scale into B would hold inf."""
    model = parity_engine(tiny)
    small = {k: v * 1e-20 for k, v in lora(tiny, 0).items()}  # keeps the merged bound far from the range at 1e10
    update_lora_packed(model, pack(small), 1e10)
    update_lora_packed(model, pack({k: v * 1e-20 for k, v in lora(tiny, 1).items()}), 1e10)
    assert len(general_calls) == 1
    b = sorted(small)[1]
    bad = dict(small)
    bad[b] = small[b].clone()
    bad[b].view(-1)[0] = 1e30
    with pytest.raises(ValueError, match=f"{b} × scale 1e\\+10 reaches"):
        update_lora_packed(model, pack(bad), 1e10)


def test_another_layout_or_a_merge_leaves_the_arena(tiny, general_calls):
    model = parity_engine(tiny)
    update_lora_packed(model, pack(lora(tiny, 0)), 0.5)
    first = model.lora_arena
    update_lora_packed(model, pack(lora(tiny, 1, rank=8)), 0.5)  # another rank: general path, a new arena
    assert len(general_calls) == 2 and model.lora_arena is not first
    update_lora_packed(model, pack(lora(tiny, 2, rank=8)), 0.25)  # another scale: the same
    assert len(general_calls) == 3
    fresh = parity_engine(tiny)
    update_lora(fresh, lora(tiny, 2, rank=8), 0.25)
    assert_bitwise(forward(model, tiny[0]), forward(fresh, tiny[0]), "after a layout change")
    with pytest.warns(UserWarning, match="LoRA merge requested under a parity patch group"):
        update_lora_packed(model, pack(lora(tiny, 3, rank=8)), 0.25, "merged")
    assert model.lora_arena is None and lora_checksum(model) == tensors_checksum(lora_state(model))


def test_bucket_packer_refills_its_buffers_with_the_bytes_pack_writes():
    packer = BucketPacker(max_bytes=512)  # small buckets: several of them
    first = {f"m{i}.lora_A.weight": torch.randn(4, 33 + i).to(BF16) for i in range(6)}
    buckets = packer.pack(first)
    assert len(buckets) > 1
    ptrs = [b.buffer.data_ptr() for b in buckets]
    second = {k: torch.randn_like(v, dtype=torch.float32).to(BF16) for k, v in first.items()}
    again = packer.pack(second)
    assert [b.buffer.data_ptr() for b in again] == ptrs, "a same-layout pack allocated new buffers"
    for got, want in zip(again, pack(second, 512)):
        assert got.manifest == want.manifest and torch.equal(got.buffer, want.buffer)
    other = packer.pack({**second, "z.lora_B.weight": torch.ones(3, 4, dtype=BF16)})  # a new layout: packed afresh
    assert [b.buffer.data_ptr() for b in other] != ptrs


def test_the_scale_is_judged_and_held_as_the_general_path_does(tiny, general_calls):
    """An int scale is held as the float the general path holds (the weights checksum hashes it); a bool or a
    tensor scale, refused by the general path, is not waved through by the fast path's equality."""
    model = parity_engine(tiny)
    update_lora_packed(model, pack(lora(tiny, 0)), 1)
    update_lora_packed(model, pack(lora(tiny, 1)), 1)
    assert len(general_calls) == 1
    assert {type(a.scale) for m in model.modules() if hasattr(m, "adapters") for a in m.adapters if a} == {float}
    for bad, words in ((True, "scale must be a number, got bool"), (torch.tensor(1.0), "got Tensor")):
        with pytest.raises(ValueError, match=words):
            update_lora_packed(model, pack(lora(tiny, 2)), bad)


def test_an_install_outside_the_arena_or_a_full_load_drops_it(tiny, monkeypatch):
    """The runner's unpacked path copies into the arena's views where shapes match and may add adapters beside
    them; a full-weight load clears the LoRA. Either way the arena no longer says what the layers hold."""
    from trueflow.engine import model_runner
    from trueflow.engine.model_runner import ModelRunner
    from trueflow.models.spec import Expert

    model = parity_engine(tiny)
    runner = ModelRunner([(Expert("transformer"), model)], model.family, torch.device("cpu"), BF16)
    runner.update_lora(lora(tiny, 0), 0.5)
    assert model.lora_arena is not None
    monkeypatch.setattr(model_runner, "as_buckets", lambda state: None)  # e.g. tensors on two devices
    first = sorted(lora(tiny, 1))[:2]  # one module: in place into the arena's views, the others cleared
    runner.update_lora({k: lora(tiny, 1)[k] for k in first}, 0.5)
    assert model.lora_arena is None
    assert runner.lora_checksum() == tensors_checksum({k: lora(tiny, 1)[k] for k in first})
    runner.update_lora(lora(tiny, 2), 0.5)
    monkeypatch.undo()
    runner.update_lora(lora(tiny, 3), 0.5)
    assert model.lora_arena is not None
    runner.load_weights(tiny[1])
    assert model.lora_arena is None and runner.lora_checksum() == tensors_checksum({})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_buckets_update_a_cuda_arena(tiny, general_calls):
    """A LoRA given as CPU tensors (a server's file or JSON update) to an engine on CUDA: checked where it lies,
    copied to the arena's device, equal to the general path."""
    from trueflow.engine.weights import build_engine_transformer

    def cuda_engine():
        return build_engine_transformer(tiny[0], tiny[1], "cuda", BF16, "qwen_image")

    model = cuda_engine()
    for seed in (0, 1):
        update_lora_packed(model, pack(lora(tiny, seed)), 0.5)
    assert len(general_calls) == 1
    general = cuda_engine()
    update_lora(general, lora(tiny, 1), 0.5)
    assert lora_checksum(model) == tensors_checksum(lora_state(general))
