"""Tensor-parallel loose ends: an HTTP engine sends a tensor-parallel server its LoRA as CPU tensors (the server's
ranks cannot open CUDA IPC handles), and no LTX-2.3 engine rank is sent (or one-process engine reads) the
checkpoint's audio stream, which the engine drops."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from torch._subclasses.fake_tensor import FakeTensorMode

from trueflow.placement import EngineSpec
from trueflow import loading
from trueflow.placement import http as http_engine
from trueflow.engine.engine import Engine
from trueflow.placement.http import HttpEngine
from trueflow.engine.weights import load_engine_transformer
from trueflow.models.ltx2.weights import NAMES, is_audio_only
from trueflow.models.weight_map import expected_tensors
from trueflow.parallel import engine as tp_engine
from trueflow.net import free_port
from trueflow.parallel.comm import init_tp
from trueflow.parity import tp as parity_tp
from trueflow.parity.probe import ProbeSpec


@pytest.mark.parametrize("tp, device", [(2, "cpu"), (1, "cuda")])
def test_an_http_engine_sends_a_tp_server_cpu_tensors(monkeypatch, tp, device):
    """The route chosen from the server's health: CUDA tensors (fake ones: no GPU here) go as CPU copies to a
    `serve --tp 2` server, as they are to a one-process server (CUDA IPC)."""
    monkeypatch.setattr(HttpEngine, "health", lambda self: {"status": "ok", "tp": tp} if tp > 1 else {"status": "ok"})
    sent = {}
    monkeypatch.setattr(http_engine, "push_lora", lambda url, state, *args, **kwargs: sent.update(state) or "sum")
    with FakeTensorMode():
        lora = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 64, device="cuda"),
                "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 2, device="cuda")}
    assert HttpEngine("http://127.0.0.1:1").update_weights(lora, 1.0, "unmerged") == "sum"
    assert sorted(sent) == sorted(lora)
    assert {t.device.type for t in sent.values()} == {device}
    assert [t.shape for t in sent.values()] == [t.shape for t in lora.values()]


def _received(rank: int, tp: int, port: int, checkpoint: str, how: str, queue) -> None:
    """An LTX-2.3 engine rank built as `EngineClient(tp=2)` builds it (`how` "engine") or as `parity --tp 2` does
    ("probe"); reports the names of the tensors it was sent."""
    torch.set_num_threads(1)
    module = parity_tp if how == "probe" else tp_engine  # where the loading code finds `scatter_shards`
    scatter, got = module.scatter_shards, {}

    def recorded(*args, **kwargs):
        got.update(scatter(*args, **kwargs))
        return got

    module.scatter_shards = recorded
    if how == "probe":  # the probe's rank 0 answers first, with its result
        parity_tp._rank(rank, tp, port, ProbeSpec(checkpoint=checkpoint), "ltx", (), None, 1, queue)
    else:
        group = init_tp(rank, tp, port, torch.device("cpu"))
        try:
            Engine(checkpoint, "ltx", tp=group)
        finally:
            torch.distributed.destroy_process_group()
    queue.put((rank, sorted(got)))


def _audio_in_file(checkpoint) -> list[str]:
    (path,) = (checkpoint / "transformer").glob("*.safetensors")
    with safe_open(str(path), "pt") as f:
        return [k for k in f.keys() if is_audio_only(k)]


@pytest.mark.parametrize("how", ["engine", "probe"])
def test_no_ltx2_rank_is_sent_the_audio_stream(ltx2_checkpoint, how):
    assert _audio_in_file(ltx2_checkpoint), "the tiny checkpoint should hold an audio stream to leave out"
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_received, args=(2, free_port(), str(ltx2_checkpoint), how, queue), nprocs=2, join=True)
    answers = [queue.get() for _ in range(3 if how == "probe" else 2)]
    assert not [a for a in answers if isinstance(a, str)]  # a probe that refused its input
    received = sorted(a for a in answers if isinstance(a, tuple))
    assert [rank for rank, _ in received] == [0, 1]
    for rank, names in received:
        assert names and not [n for n in names if is_audio_only(n)], f"rank {rank} was sent audio tensors"


def test_a_one_process_ltx2_engine_reads_no_audio_tensor(ltx2_checkpoint, monkeypatch):
    read = loading.read_transformer_state_dict
    got = {}
    monkeypatch.setattr(loading, "read_transformer_state_dict", lambda *a, **k: got.setdefault("state", read(*a, **k)))
    engine = load_engine_transformer(str(ltx2_checkpoint), family="ltx2")
    assert not [n for n in got["state"] if is_audio_only(n)]
    assert len(got["state"]) == len(expected_tensors(engine, NAMES))  # the video stream, every tensor of it


def test_a_lora_refused_by_one_tp_rank_is_applied_by_none(tiny_checkpoint):
    """The merged-weight bound holds per slice: B's rows of rank 1 (a column-parallel q) at 2e19 with A at 1e19
    overflow bf16 there, while rank 0's rows at 1 pass. The update is refused on every rank, naming rank 1, and
    every rank still holds the LoRA before it (the client's checksum confirms each rank's slice)."""
    import warnings

    from trueflow.placement.process import EngineClient, EngineRequestRefused

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TP gate
        client = EngineClient(EngineSpec(str(tiny_checkpoint), "qwen_image", threads=1), tp=2)
    try:
        g = torch.Generator().manual_seed(0)
        q = "transformer_blocks.0.attn.to_q"
        inner, rank = 64, 2  # the tiny model's 2 heads x 32
        good = {f"{q}.lora_A.weight": (torch.randn(rank, inner, generator=g) * 0.1).to(torch.bfloat16),
                f"{q}.lora_B.weight": (torch.randn(inner, rank, generator=g) * 0.1).to(torch.bfloat16)}
        before = client.update_weights(good, 1.0, "unmerged")
        bad = {k: v.clone() for k, v in good.items()}
        bad[f"{q}.lora_A.weight"].fill_(1e19)
        bad[f"{q}.lora_B.weight"][:inner // 2] = 1.0  # rank 0's output rows
        bad[f"{q}.lora_B.weight"][inner // 2:] = 2e19  # rank 1's
        with pytest.raises(EngineRequestRefused, match="tp rank 1: cannot load LoRA, nothing was applied") as info:
            client.update_weights(bad, 1.0, "unmerged")
        assert "tp rank 0" not in str(info.value)
        assert client.checksum() == before, "a rank installed its slice of a refused update"
    finally:
        client.shutdown()
