"""The whole engine transformer against the train side (diffusers + PEFT) through the parity probe: bitwise with
the `qwen_image` patch group, across shapes, LoRA updates and transformer configs; not bitwise without it."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import LoraMasters, assert_bitwise, assert_differs, engine_forward, train_forward, \
    write_transformer_checkpoint
from trueflow.engine.weights import build_engine_transformer
from trueflow.models.lora import update_lora
from trueflow.models.qwen_image.presets import transformer_config
from trueflow.models.qwen_image.patches import GROUP
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.train.model import lora_state_dict

LORA_STEP_STD = 2e-3  # a stand-in optimizer step on the fp32 LoRA masters


def assert_bitwise_result(probe: ParityProbe, result, out: torch.Tensor, disabled=()) -> None:
    assert result.bitwise_equal
    assert result.model_output_max_abs_diff == 0.0 and result.model_output_mean_abs_diff == 0.0
    assert result.first_differing_module is None
    assert result.patches_applied == [p for p in GROUP.patch_names if p not in disabled]
    assert result.layers and all(row.max_abs_diff == 0.0 for row in result.layers)
    assert_bitwise(out, probe.train_output, "model output")


def assert_not_bitwise_result(probe: ParityProbe, result, out: torch.Tensor) -> None:
    assert not result.bitwise_equal
    assert result.model_output_max_abs_diff > 0.0
    assert result.first_differing_module is not None
    assert_differs(out, probe.train_output, "model output")


@pytest.mark.parametrize("resolution", [64, 128])
@pytest.mark.parametrize("text_len", [7, 33])
@pytest.mark.parametrize("batch", [1, 4], ids=["batch1", "microgroup4"])
def test_group_is_bitwise_and_none_is_not(tiny_checkpoint, batch, text_len, resolution):
    probe = ParityProbe(ProbeSpec(checkpoint=str(tiny_checkpoint), batch=batch, text_len=text_len,
                                  resolution=resolution))
    side = resolution // 16
    assert probe.inputs["hidden_states"].shape == (batch, side * side, 64)
    assert probe.inputs["cond"]["encoder_hidden_states"].shape[:2] == (batch, text_len)
    assert probe.train_backend == "_native_flash"
    result, out = probe.run("qwen_image")
    assert_bitwise_result(probe, result, out)
    # the failing side: the engine's bf16 fast path (no patch group)
    off, off_out = probe.run("none")
    assert off.patches_applied == []
    assert_not_bitwise_result(probe, off, off_out)


@pytest.fixture
def lora_probe(tiny_checkpoint) -> ParityProbe:
    """Microgroup 4 with a rank-8 PEFT LoRA whose B is non-zero (function scope: tests step its LoRA)."""
    probe = ParityProbe(ProbeSpec(checkpoint=str(tiny_checkpoint), batch=4, lora_rank=8))
    b = [p for n, p in probe.train.named_parameters() if ".lora_B." in n]
    assert b and all(p.abs().max() > 0 for p in b)
    return probe


def test_lora_updates_stay_bitwise(lora_probe):
    """Three successive LoRA updates pushed into the SAME engine instance: bitwise after each one, each one
    changes the output, and the fast engine (merged, no group) fed the same updates is not bitwise."""
    probe = lora_probe
    scale = probe.lora[1]
    engine = probe.build_engine("qwen_image")
    fast = probe.build_engine("none")
    no_lora = build_engine_transformer(probe.config, probe.state_dict, patch_group="qwen_image")
    prev = engine_forward(engine, probe.inputs)
    assert_bitwise(prev, probe.train_output, "before any update")
    assert_differs(engine_forward(no_lora, probe.inputs), prev, "the LoRA changes the output")
    masters = LoraMasters(probe.train)
    for step in range(1, 4):
        masters.step(seed=100 + step, std=LORA_STEP_STD)
        update = lora_state_dict(probe.train)
        update_lora(engine, update, scale)
        update_lora(fast, update, scale)
        ref = train_forward(probe)
        out = engine_forward(engine, probe.inputs)
        assert_bitwise(out, ref, f"after update {step}")
        assert_differs(out, prev, f"update {step} changed the output")
        assert_differs(engine_forward(fast, probe.inputs), ref, f"fast engine after update {step}")
        prev = out


@pytest.mark.parametrize("patch_group", ["qwen_image", "none"])
def test_engine_lora_is_a_snapshot(lora_probe, patch_group):
    """The engine holds the LoRA of its last update: a train-side step that is not pushed must not change the
    rollout's output (in-place optimizer steps on the compute copies must not leak into the engine)."""
    probe = lora_probe
    engine = probe.build_engine(patch_group)
    before = engine_forward(engine, probe.inputs)
    LoraMasters(probe.train).step(seed=7, std=LORA_STEP_STD)
    assert_differs(train_forward(probe), probe.train_output, "the train side moved")
    assert_bitwise(engine_forward(engine, probe.inputs), before,
                   "engine output changed without a weight update (adapters alias the train side's tensors?)")


def test_lora_group_off_and_merged_mode(lora_probe):
    probe = lora_probe
    result, out = probe.run("qwen_image")
    assert_bitwise_result(probe, result, out)
    off, off_out = probe.run("none")  # the fast engine merges the LoRA
    assert_not_bitwise_result(probe, off, off_out)
    # an explicit merged mode under the group is honoured, with a warning that parity is gone
    probe.spec.lora_merge_mode = "merged"
    with pytest.warns(UserWarning, match="no longer bitwise"):
        merged, merged_out = probe.run("qwen_image")
    assert_not_bitwise_result(probe, merged, merged_out)
    # an explicit unmerged mode is the group's own choice: no warning, bitwise
    probe.spec.lora_merge_mode = "unmerged"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, out = probe.run("qwen_image")
    assert not [w for w in caught if "merge" in str(w.message).lower()]
    assert_bitwise_result(probe, result, out)


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_fp32_engine_matches_diffusers_fp32(tiny_checkpoint, lora_rank):
    """No patch group in fp32: equal up to fp32 rounding (the fast paths are numerically right, just not
    bitwise). The same fast paths in bf16 are not bitwise (test_group_is_bitwise_and_none_is_not)."""
    probe = ParityProbe(ProbeSpec(checkpoint=str(tiny_checkpoint), batch=4, dtype="fp32", lora_rank=lora_rank))
    result, out = probe.run("none")
    assert out.dtype == probe.train_output.dtype == torch.float32
    rel = result.model_output_max_abs_diff / probe.train_output.abs().max().item()
    assert rel < 1e-5, f"relative error {rel:.3e}"


# A transformer config unlike every preset: the engine reads it from the checkpoint, nothing is hard-coded.
OTHER_CONFIG = {**transformer_config("tiny"), "num_layers": 3, "num_attention_heads": 4, "attention_head_dim": 16,
                "axes_dims_rope": (4, 6, 6), "joint_attention_dim": 40}


def test_other_config_checkpoint(tmp_path):
    ckpt = write_transformer_checkpoint(tmp_path / "other", OTHER_CONFIG, seed=7)
    probe = ParityProbe(ProbeSpec(checkpoint=str(ckpt), batch=4, text_len=11, resolution=96, lora_rank=4))
    assert probe.train.config.num_layers == 3 and probe.train.config.joint_attention_dim == 40
    engine = probe.build_engine("qwen_image")
    c = engine.config
    assert (c.num_layers, c.num_attention_heads, c.attention_head_dim, c.joint_attention_dim, c.axes_dims_rope) == \
        (3, 4, 16, 40, (4, 6, 6))
    assert len(engine.transformer_blocks) == 3 and engine.txt_in.in_features == 40
    result, out = probe.run("qwen_image")
    assert_bitwise_result(probe, result, out)
    off, off_out = probe.run("none")
    assert_not_bitwise_result(probe, off, off_out)


def test_one_block_real_width():
    """Real-width GEMMs (inner 3072, joint 3584) at one block, microgroup 4: the CPU negative controls that need
    the real model's widths, with a rank-8 LoRA."""
    probe = ParityProbe(ProbeSpec(random_size="one_block", batch=4, resolution=64, text_len=7, lora_rank=8))
    assert probe.train.inner_dim == 3072 and probe.config["joint_attention_dim"] == 3584
    result, out = probe.run("qwen_image")
    assert_bitwise_result(probe, result, out)
    off, off_out = probe.run("none")
    assert_not_bitwise_result(probe, off, off_out)
    # a kernel-selection patch and the LoRA patch, each switched off alone, break parity at this width on CPU
    for disabled in ("contiguous_split", "lora_unmerged"):
        res, res_out = probe.run("qwen_image", (disabled,))
        assert res.patches_applied == [p for p in GROUP.patch_names if p != disabled]
        assert_not_bitwise_result(probe, res, res_out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("train_backend", ["_native_flash", "_native_cudnn"])
def test_attention_pairings_bitwise_on_cuda(train_backend):
    """A real-width block on the GPU, microgroup 4, text 128, LoRA 64: the group made for the train side's backend
    (`qwen_image:<backend>`, with the eager-exact kernels on) is bitwise that backend's diffusers forward; the other
    pairing's kernel is not."""
    from trueflow import kernels

    assert kernels.ENABLED, "the eager-exact kernels are what this test is about (TRUEFLOW_TRITON=0 is set?)"
    probe = ParityProbe(ProbeSpec(random_size="one_block", batch=4, text_len=128, resolution=512, lora_rank=64,
                                  device="cuda"))
    probe.train_backend = train_backend
    probe._train_forward()
    result, out = probe.run(f"qwen_image:{train_backend}")
    assert result.engine_attention_backend == {"_native_flash": "flash", "_native_cudnn": "cudnn"}[train_backend]
    assert_bitwise_result(probe, result, out)
    other = {"_native_flash": "qwen_image:_native_cudnn", "_native_cudnn": "qwen_image"}[train_backend]
    off, off_out = probe.run(other)
    assert_not_bitwise_result(probe, off, off_out)
