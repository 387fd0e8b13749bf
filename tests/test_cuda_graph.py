"""`GraphedForward`: eager fallback on CPU, LoRA-state tracking, and (on CUDA) replay bitwise equal to eager,
for the fast path and the `qwen_image` patch group, across LoRA updates."""

from __future__ import annotations

import pytest
import torch

from conftest import BF16, assert_bitwise, randn
from trueflow.engine.cuda_graph import GraphedForward, LoraState
from trueflow.engine.weights import build_engine_transformer
from trueflow.models.lora import update_lora
from trueflow.models.qwen_image.weights import load_weights

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LORA_TARGETS = ("attn.to_q", "attn.add_v_proj", "attn.to_out.0", "img_mlp.net.0.proj", "txt_mlp.net.2")


def engine(tiny, device: str, group: str = "none"):
    return build_engine_transformer(tiny[0], tiny[1], device, BF16, group)


def inputs(config: dict, batch: int, text_len: int, side: int, device: str, seed: int = 0) -> dict:
    """The forward's keyword arguments, as the model runner passes them."""
    hs = randn((batch, side * side, config["in_channels"]), seed).to(device)
    ehs = randn((batch, text_len, config["joint_attention_dim"]), seed + 1).to(device)
    t = torch.tensor([731.25], device=device).expand(batch)  # as the engine passes it: one timestep, expanded
    return {"hidden_states": hs, "timestep": t, "grid": (side, side), "encoder_hidden_states": ehs,
            "encoder_hidden_states_mask": None}


def peft_lora(config: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A random PEFT-format LoRA on a few targets of every block (B non-zero so the adapter matters)."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    dims = {"attn.to_q": (inner, inner), "attn.add_v_proj": (inner, inner), "attn.to_out.0": (inner, inner),
            "img_mlp.net.0.proj": (inner, 4 * inner), "txt_mlp.net.2": (4 * inner, inner)}
    out = {}
    for i in range(config["num_layers"]):
        for j, name in enumerate(LORA_TARGETS):
            d_in, d_out = dims[name]
            prefix = f"transformer_blocks.{i}.{name}"
            out[f"{prefix}.lora_A.weight"] = randn((rank, d_in), seed + 10 * j + i, std=0.1)
            out[f"{prefix}.lora_B.weight"] = randn((d_out, rank), seed + 10 * j + i + 5, std=0.1)
    return out


@torch.no_grad()
def test_cpu_runs_eagerly(tiny):
    model = engine(tiny, "cpu")
    graphed = GraphedForward(model)
    x = inputs(tiny[0], 2, 7, 4, "cpu")
    assert_bitwise(graphed(**x), model(**x), "CPU GraphedForward vs eager")
    assert graphed.captures == 0 and not graphed.graphs


@torch.no_grad()
def test_lora_state_sees_every_change_that_replaces_tensors(tiny):
    """Unmerged adapters: a first install and another rank are new tensors (the state no longer matches); an
    update of the same shapes and scale copies into them (it still matches). A merged update copies into the
    weights in place: it still matches. A full-weight load clears the LoRA: it does not match."""
    config = tiny[0]
    parity = engine(tiny, "cpu", "qwen_image")  # keeps LoRA unmerged
    state = LoraState(parity)
    assert state.matches()
    update_lora(parity, peft_lora(config, 4, 1), scale=1.0)
    assert not state.matches()
    state = LoraState(parity)
    update_lora(parity, peft_lora(config, 4, 2), scale=1.0)  # same shapes: copied in place
    assert state.matches()
    update_lora(parity, peft_lora(config, 8, 2), scale=1.0)  # another rank: new tensors
    assert not state.matches()

    fast = engine(tiny, "cpu")  # merges
    update_lora(fast, peft_lora(config, 4, 1), scale=1.0)
    state = LoraState(fast)
    update_lora(fast, peft_lora(config, 4, 2), scale=0.5)
    assert state.matches()
    load_weights(fast, tiny[1])
    assert not state.matches()


# -- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group", ["none", "qwen_image"])
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_replay_is_bitwise_eager(tiny, group, batch):
    model = engine(tiny, "cuda", group)
    graphed = GraphedForward(model)
    shapes = [(7, 4), (33, 8)]  # (text length, latent side): two graphs
    for text_len, side in shapes:
        for seed in (0, 1):  # new inputs into the same graph
            x = inputs(tiny[0], batch, text_len, side, "cuda", seed)
            assert_bitwise(graphed(**x), model(**x), f"{group} b{batch} text {text_len} side {side} seed {seed}")
    assert graphed.captures == len(shapes)
    pos, neg = graphed(**inputs(tiny[0], batch, 7, 4, "cuda", 0)), graphed(**inputs(tiny[0], batch, 7, 4, "cuda", 1))
    assert not torch.equal(pos, neg), "the second branch's replay overwrote the first branch's output"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group", ["none", "qwen_image"])
@torch.no_grad()
def test_replay_after_lora_updates(tiny, group):
    """Unmerged (qwen_image): same-shape updates copy into the adapters, so the captured graph replays the new
    LoRA without a re-capture; another rank re-captures. Merged (none): the graph stays valid throughout. Either
    way every replay is bitwise the eager forward with the new LoRA."""
    model = engine(tiny, "cuda", group)
    graphed = GraphedForward(model)
    x = inputs(tiny[0], 2, 7, 4, "cuda")
    outs = []
    for step, rank in enumerate((4, 4, 4, 8)):
        update_lora(model, peft_lora(tiny[0], rank, seed=step), scale=1.0)
        outs.append(graphed(**x))
        assert_bitwise(outs[-1], model(**x), f"{group} after LoRA update {step}")
        if step == 2:
            assert (graphed.captures, graphed.invalidations) == (1, 0), "a same-shape update re-captured"
    assert not torch.equal(outs[1], outs[2]), "the replay did not see the update"
    merged = group == "none"
    assert (graphed.captures, graphed.invalidations) == ((1, 0) if merged else (2, 1))


@pytest.mark.gpu
@needs_cuda
@torch.no_grad()
def test_eager_when_disabled_or_grad(tiny):
    model = engine(tiny, "cuda")
    x = inputs(tiny[0], 1, 7, 4, "cuda")
    off = GraphedForward(model, enabled=False)
    assert_bitwise(off(**x), model(**x), "disabled")
    graphed = GraphedForward(model)
    with torch.enable_grad():
        graphed(**x)
    assert off.captures == graphed.captures == 0



@pytest.mark.gpu
@needs_cuda
@torch.no_grad()
def test_replay_after_packed_lora_updates(tiny):
    """A LoRA sent as buckets (as the engine process receives it): the first install moves the adapters into the
    arena (one re-capture), every later same-layout update is one copy per bucket into that arena, and the graph
    replays it without a re-capture, bitwise the eager forward."""
    from trueflow.engine.lora_arena import update_lora_packed
    from trueflow.sync.buckets import pack

    model = engine(tiny, "cuda", "qwen_image")
    graphed = GraphedForward(model)
    x = inputs(tiny[0], 2, 7, 4, "cuda")
    update_lora(model, peft_lora(tiny[0], 4, seed=0), scale=1.0)
    graphed(**x)  # captured over the adapters of the general path
    outs = []
    for step in range(1, 4):
        lora = {k: v.to("cuda", BF16) for k, v in peft_lora(tiny[0], 4, seed=step).items()}
        update_lora_packed(model, pack(lora), 1.0)
        outs.append(graphed(**x))
        assert_bitwise(outs[-1], model(**x), f"after packed update {step}")
    assert model.lora_arena is not None
    assert (graphed.captures, graphed.invalidations) == (2, 1), "the arena's updates re-captured"
    assert not torch.equal(outs[-1], outs[-2]), "the replay did not see the update"
