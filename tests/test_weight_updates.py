"""Weight updates are judged as the engine would hold them, after the cast to its dtype (bf16), the LoRA scale
included, and are all-or-nothing: a refused update raises one ValueError naming the tensor and the reason, and
leaves the engine's weights checksum, LoRA checksum and a seeded rollout exactly as they were. Covered for LoRA
and full weights through the engine's API, from a safetensors file, through weight buckets (what the server's IPC
route unpacks) and through the engine process (`EngineClient`, LoRA over IPC handles)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import BF16, randn
from trueflow.placement import EngineSpec
from trueflow.engine.interface import RolloutRequest
from trueflow.engine.engine import Engine
from trueflow.engine.sampling_params import SamplingParams
from trueflow.layers.linear import Linear
from trueflow.loading import read_transformer_state_dict
from trueflow.models.qwen_image.weights import map_module_name
from trueflow.sync.buckets import pack, unpack
from trueflow.placement.process import EngineClient, EngineRequestRefused

PARAMS = SamplingParams(steps=2, height=16, width=16, cfg_scale=1.0)
Q = "transformer_blocks.0.attn.to_q"  # attention, a slot of the packed q/k/v weight (where the audit saw it)
MLP = "transformer_blocks.1.img_mlp.net.2"
RANK = 4
BF16_MAX = torch.finfo(BF16).max  # 3.3895e38; fp32 reaches 3.4028e38, fp64 1.8e308


def _layer_dims(engine: Engine, module: str) -> tuple[int, int]:
    engine_name, slot = map_module_name(module)
    layer = dict(engine.transformer.named_modules())[engine_name]
    assert isinstance(layer, Linear)
    return layer.in_features, layer.splits[slot or 0]


def make_lora(engine: Engine, seed: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, module in enumerate((Q, MLP)):
        d_in, d_out = _layer_dims(engine, module)
        out[f"{module}.lora_A.weight"] = randn((RANK, d_in), seed + 2 * i, std=0.1)
        out[f"{module}.lora_B.weight"] = randn((d_out, RANK), seed + 2 * i + 1, std=0.1)
    return out


def with_value(t: torch.Tensor, value: float, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` with its first element set to `value`."""
    t = t.to(dtype).clone()
    t.view(-1)[0] = value
    return t


def checksums(engine) -> tuple[str, ...]:
    """Weights (parameters, LoRA tensors, scales) and LoRA checksums; the engine process exposes the latter."""
    return (engine.weights_checksum(), engine.checksum()) if isinstance(engine, Engine) else \
        (engine.checksum(),)


def fingerprint(engine) -> tuple:
    """What a refused update must not change: the checksums and a seeded rollout's latents and log-probs."""
    mg = engine.rollout(RolloutRequest(["a red apple"], 1, PARAMS, seed=7, decode=False)).microgroups[0]
    return checksums(engine), mg.latents, mg.log_probs


def assert_same(after: tuple, before: tuple, what: str) -> None:
    assert after[0] == before[0], f"{what}: a checksum changed"
    for a, b, name in zip(after[1:], before[1:], ("latents", "log_probs")):
        assert torch.equal(a, b), f"{what}: the rollout's {name} changed"


def assert_changed(after: tuple, before: tuple, what: str) -> None:
    assert after[0] != before[0] and not torch.equal(after[1], before[1]), f"{what}: expected a change"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine(tiny_checkpoint)  # patch group "none": merges by default, and takes merge_mode="unmerged"


def test_the_audit_values_are_finite_as_given_and_inf_in_bf16():
    """The premise of the cases below, from the IEEE formats alone."""
    for value, dtype in ((1e300, torch.float64), (3.4e38, torch.float32), (1e308, torch.float64)):
        given = torch.tensor(value, dtype=dtype)
        assert torch.isfinite(given) and torch.isinf(given.to(BF16)), (value, dtype)
    assert torch.isfinite(torch.tensor(BF16_MAX, dtype=torch.float32).to(BF16))


def bad_lora_updates(engine: Engine) -> dict[str, tuple[dict[str, torch.Tensor], float, str]]:
    """what -> (update, scale, words the error must hold). Every update also changes every valid tensor, so a
    partly applied update would show."""
    good = make_lora(engine, 100)
    qa, qb, ma, mb = (f"{m}.lora_{ab}.weight" for m in (Q, MLP) for ab in "AB")
    d_in, d_out = _layer_dims(engine, Q)
    return {
        "F64 LoRA at 1e300": ({**good, qa: with_value(good[qa], 1e300, torch.float64)}, 1.0,
                              f"{qa} holds |value| 1e+300, inf in bfloat16"),
        "F32 LoRA at 3.4e38": ({**good, mb: with_value(good[mb], 3.4e38, torch.float32)}, 1.0,
                               f"{mb} holds |value| 3.4e+38, inf in bfloat16"),
        "scale 1e308": (good, 1e308, "scale 1e+308 is not finite in bfloat16"),
        "scale NaN": (good, math.nan, "scale nan is not finite in bfloat16"),
        "scale not a number": (good, "1.0", "scale must be a number, got str"),
        # 1e30 and 1e10 are finite in bf16, their product is not: an engine folding the scale into B holds inf
        "scale·B overflows": ({**good, qb: with_value(good[qb], 1e30, BF16)}, 1e10,
                              f"{qb} × scale 1e+10 reaches 1e+40"),
        # A and B at 2e19, each finite, scale·B finite: their product, the merged weight, is not
        "merged weight overflows": ({**good, ma: with_value(good[ma], 2e19, BF16),
                                     mb: with_value(good[mb], 2e19, BF16)}, 1.0,
                                    f"{MLP}: the merged weight W + scale·B·A may reach"),
        "NaN": ({**good, qa: with_value(good[qa], math.nan, torch.float32)}, 1.0, f"{qa} holds NaN"),
        "inf": ({**good, mb: with_value(good[mb], math.inf, torch.float32)}, 1.0, f"{mb} holds inf"),
        "integer tensor": ({**good, qa: torch.ones(RANK, d_in, dtype=torch.int64)}, 1.0,
                           f"{qa} is torch.int64, not a floating-point tensor"),
        "shape": ({**good, qb: torch.zeros(d_out + 1, RANK)}, 1.0,
                  f"{qb} ({d_out + 1}, {RANK}) != expected ({d_out}, {RANK})"),
    }


@pytest.mark.parametrize("merge_mode", ["merged", "unmerged"])
def test_refused_lora_updates_change_nothing(engine, merge_mode):
    engine.update_weights(make_lora(engine, 0), 0.5, merge_mode)  # a LoRA in place, which must stay
    before = fingerprint(engine)
    for what, (update, scale, reason) in bad_lora_updates(engine).items():
        with pytest.raises(ValueError, match="cannot load LoRA, nothing was applied") as info:
            engine.update_weights(update, scale, merge_mode)
        assert reason in str(info.value), (what, str(info.value))
        assert checksums(engine) == before[0], what
    assert_same(fingerprint(engine), before, "after every refused update")
    # the failing side: a valid update changes both checksums and the rollout
    engine.update_weights(make_lora(engine, 100), 1.0, merge_mode)
    assert_changed(fingerprint(engine), before, "a valid update")


def test_values_at_the_bf16_bound_are_taken_and_past_it_refused(engine):
    """bf16's largest finite value is (2 - 2^-7)·2^127, its last step 2^120: an fp32 value below the midpoint
    max + 2^119 rounds to max, the midpoint itself rounds (to even) to inf."""
    midpoint = torch.tensor(BF16_MAX + 2.0 ** 119, dtype=torch.float32)
    below = torch.nextafter(midpoint, torch.tensor(0.0))
    lora = make_lora(engine, 0)
    qa, qb = f"{Q}.lora_A.weight", f"{Q}.lora_B.weight"
    tiny_a = lora[qa] * 1e-30  # keeps scale·B·A small, so only B's own value is at stake
    engine.update_weights({**lora, qa: tiny_a, qb: with_value(lora[qb], below.item(), torch.float32)}, 1.0)
    held = dict(engine.transformer.named_modules())[map_module_name(Q)[0]].adapters[0].B
    assert held.view(-1)[0].item() == BF16_MAX
    before = fingerprint(engine)
    with pytest.raises(ValueError) as info:
        engine.update_weights({**lora, qa: tiny_a, qb: with_value(lora[qb], midpoint.item(), torch.float32)}, 1.0)
    assert f"{qb} holds |value| 3.396e+38, inf in bfloat16" in str(info.value)
    assert_same(fingerprint(engine), before, "past the bound")


def bad_full_updates(state: dict[str, torch.Tensor]) -> dict[str, tuple[dict[str, torch.Tensor], str]]:
    """what -> (full state dict, words the error must hold); every valid tensor is changed too."""
    changed = {k: v + 0.01 for k, v in state.items()}
    k, w = "transformer_blocks.0.attn.to_k.weight", "img_in.weight"  # a packed slot, a plain weight
    return {
        "full weights at 1e300": ({**changed, k: with_value(changed[k], 1e300, torch.float64)},
                                  f"{k} holds |value| 1e+300, inf in bfloat16"),
        "F32 full weights at 3.4e38": ({**changed, w: with_value(changed[w], 3.4e38, torch.float32)},
                                       f"{w} holds |value| 3.4e+38, inf in bfloat16"),
        "NaN": ({**changed, w: with_value(changed[w], math.nan, BF16)}, f"{w} holds NaN"),
        "integer tensor": ({**changed, w: changed[w].to(torch.int32)}, f"{w} is torch.int32, not a floating-point"),
        "shape": ({**changed, w: torch.zeros(changed[w].shape[0], changed[w].shape[1] - 1)},
                  f"{w} ({changed[w].shape[0]}, {changed[w].shape[1] - 1}) != expected "
                  f"({changed[w].shape[0]}, {changed[w].shape[1]})"),
    }


def test_refused_full_updates_change_nothing(engine, tiny_checkpoint):
    state = read_transformer_state_dict(tiny_checkpoint)
    engine.update_weights(state)
    engine.update_weights(make_lora(engine, 0), 0.5)  # a full update drops the LoRA: a refused one must not
    before = fingerprint(engine)
    for what, (update, reason) in bad_full_updates(state).items():
        with pytest.raises(ValueError, match="cannot load weights, nothing was applied") as info:
            engine.update_weights(update)
        assert reason in str(info.value), (what, str(info.value))
        assert checksums(engine) == before[0], what
    assert_same(fingerprint(engine), before, "after every refused update")
    engine.update_weights({k: v + 0.01 for k, v in state.items()})  # the failing side
    assert_changed(fingerprint(engine), before, "a valid full update")
    engine.update_weights(state)


def test_updates_from_files_and_buckets_are_refused_alike(engine, tiny_checkpoint, tmp_path):
    """What the server's routes do: a safetensors file read back (F64 survives the file), or buckets unpacked."""
    state = read_transformer_state_dict(tiny_checkpoint)
    engine.update_weights(state)
    engine.update_weights(make_lora(engine, 0), 0.5)
    before = fingerprint(engine)
    lora_update, _, lora_reason = bad_lora_updates(engine)["F64 LoRA at 1e300"]
    full_update, full_reason = bad_full_updates(state)["full weights at 1e300"]
    for name, update in (("lora", lora_update), ("full", full_update)):
        save_file(update, str(tmp_path / f"{name}.safetensors"))
        from_file = load_file(str(tmp_path / f"{name}.safetensors"))
        buckets = pack(update, max_bytes=4 << 10)  # several buckets
        for b in buckets:
            b.buffer.share_memory_()
        for how, got in (("file", from_file), ("buckets", unpack(buckets))):
            with pytest.raises(ValueError) as info:
                engine.update_weights(got, 1.0) if name == "lora" else engine.update_weights(got)
            assert (lora_reason if name == "lora" else full_reason) in str(info.value), (name, how)
            assert checksums(engine) == before[0], (name, how)
    assert_same(fingerprint(engine), before, "after every refused update")


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    c = EngineClient(EngineSpec(str(tiny_checkpoint)))
    yield c
    c.shutdown()


def test_refused_updates_over_ipc_change_nothing(client, engine):
    good = make_lora(engine, 0)
    checksum = client.update_weights(good, 0.5)
    before = fingerprint(client)
    assert before[0] == (checksum,)
    cases = bad_lora_updates(engine)
    for what in ("F64 LoRA at 1e300", "F32 LoRA at 3.4e38", "scale 1e308", "scale·B overflows",
                 "merged weight overflows", "shape"):
        update, scale, reason = cases[what]
        for merge_mode in ("merged", "unmerged"):
            with pytest.raises(EngineRequestRefused) as info:
                client.update_weights(update, scale, merge_mode)
            assert isinstance(info.value, ValueError) and reason in str(info.value), (what, str(info.value))
            assert "Traceback" not in str(info.value)
            assert checksums(client) == before[0], (what, merge_mode)
    assert_same(fingerprint(client), before, "after every refused update over IPC")
    client.update_weights(make_lora(engine, 100), 1.0)  # the failing side
    assert_changed(fingerprint(client), before, "a valid update over IPC")
