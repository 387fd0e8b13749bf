"""Tensor-parallel loose ends: an HTTP engine sends a tensor-parallel server its LoRA as CPU tensors (the server's
ranks cannot open CUDA IPC handles), and an LTX-2.3 rank never receives the checkpoint's audio stream."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trueflow.engine import http_engine
from trueflow.engine.http_engine import HttpEngine


@pytest.mark.parametrize("tp, device", [(2, "cpu"), (1, "cuda")])
def test_an_http_engine_sends_a_tp_server_cpu_tensors(monkeypatch, tp, device):
    """The route chosen from the server's health: CUDA tensors (fake ones: no GPU here) go as CPU copies to a
    `serve --tp 2` server, as they are to a one-process server (CUDA IPC)."""
    monkeypatch.setattr(HttpEngine, "health", lambda self: {"status": "ok", "tp": tp} if tp > 1 else {"status": "ok"})
    sent = {}
    monkeypatch.setattr(http_engine, "push_lora", lambda url, state, *args: sent.update(state) or "sum")
    with FakeTensorMode():
        lora = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 64, device="cuda"),
                "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 2, device="cuda")}
    assert HttpEngine("http://127.0.0.1:1").update_weights(lora, 1.0, "unmerged") == "sum"
    assert sorted(sent) == sorted(lora)
    assert {t.device.type for t in sent.values()} == {device}
    assert [t.shape for t in sent.values()] == [t.shape for t in lora.values()]
