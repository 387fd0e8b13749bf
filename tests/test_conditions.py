"""Each condition of bitwise parity (docs/patch-group.md) broken in turn, at the level of one train step: its warning
appears, and the diff is non-zero wherever this CPU can show one."""

from __future__ import annotations

import pytest
import torch

from trueflow.train.config import ParityConditionWarning, TrainConfig
from trueflow.train.metrics import read_metrics
from trueflow.train.run import run_training

BASE = dict(steps=3, num_sde_steps=1, rollout_batch_size=2, n_samples_per_prompt=4, rollout_microgroup_size=4,
            micro_batch_size_sample=4, num_rollouts=1, sample_every=0)


def broken_run(tmp_path, checkpoint, warning: str, **overrides) -> list[dict]:
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), checkpoint=str(checkpoint), **{**BASE, **overrides})
    with pytest.warns(ParityConditionWarning, match=warning):
        run_training(cfg)
    return read_metrics(tmp_path / "run" / "metrics.jsonl")


MISMATCH = ("model_output_max_abs_diff", "model_output_mean_abs_diff", "log_prob_max_abs_diff", "ratio_mean",
            "ratio_max_abs_dev_from_1")


def test_two_optimizer_steps_per_rollout(tmp_path, tiny_checkpoint):
    """The second step trains on moved weights: that is the policy's own change (policy_*), not a train/rollout
    mismatch, which is only measured where the weights are the rolled-out ones."""
    first, second = broken_run(tmp_path, tiny_checkpoint, "condition 1", num_steps_per_rollout=2)
    assert first["model_output_max_abs_diff"] == 0.0 and first["ratio_max_abs_dev_from_1"] == 0.0
    assert first["policy_ratio_mean"] == 1.0 and first["policy_log_prob_max_abs_diff"] == 0.0
    assert all(second[k] is None for k in MISMATCH) and second["parity_measured"] is False
    assert second["policy_log_prob_max_abs_diff"] > 0 and second["policy_ratio_max_abs_dev_from_1"] > 0


def test_a_micro_batch_of_mixed_prompt_lengths(tmp_path, tiny_checkpoint):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na very long prompt about a red cube standing on a wooden table in the morning sun\n")
    with pytest.warns(UserWarning, match="non-trivial text mask"):  # the train side leaves _native_flash
        broken_run(tmp_path, tiny_checkpoint, "condition 4", prompts=str(prompts), micro_batch_size_sample=8)
    # No diff to show here: on this CPU the masked kernel gives the short prompt's rows the very bits of the
    # unpadded ones, and the tiny GEMMs are batch-invariant. The warnings are the guarantee (on an H200 the
    # mask alone moved outputs by 1.6e-2).


def test_whole_window_padding(tmp_path, tiny_checkpoint):
    with pytest.warns(UserWarning, match="non-trivial text mask"):
        rows = broken_run(tmp_path, tiny_checkpoint, "condition 3", pad_text_to=64)
    assert rows[0]["model_output_max_abs_diff"] > 0


def test_another_attention_backend(tmp_path, tiny_checkpoint):
    rows = broken_run(tmp_path, tiny_checkpoint, "condition 5", fsdp_attention_backend="_native_math")
    assert rows[0]["model_output_max_abs_diff"] > 0


def test_merged_lora(tmp_path, tiny_checkpoint):
    with pytest.warns(UserWarning, match="LoRA merge requested under a parity patch group"):
        rows = broken_run(tmp_path, tiny_checkpoint, "merged", lora_merge_mode="merged", num_rollouts=2)
    # The first rollout ran before any update (B = 0, so the merge adds exactly nothing); after it, W + s·BA
    # in bf16 is not PEFT's unmerged forward.
    assert rows[0]["model_output_max_abs_diff"] == 0.0 and rows[1]["model_output_max_abs_diff"] > 0


def test_micro_batch_unlike_the_microgroup_warns(tmp_path, tiny_checkpoint):
    broken_run(tmp_path, tiny_checkpoint, "condition 4", micro_batch_size_sample=2)


def test_micro_batch_unlike_the_microgroup_differs_at_real_width():
    """The batch-shape case needs GEMMs as wide as the real model's: the real-width one-block config, engine
    microgroup of 4 vs train micro-batches of 1. Which batch shapes change bf16 bits on a CPU depends on its GEMM
    library: on some x86 CPUs M=64 vs 2 x M=32 already differs, on the AMD EPYC CI machines only a one-row GEMM
    (the GEMV path) does. A 16-pixel image is one image token, so a train micro-batch of one sample runs the
    image stream's GEMMs with M=1 while the engine's microgroup runs them with M=4."""
    from trueflow.parity.probe import ParityProbe, ProbeSpec
    from trueflow.models.qwen_image.train import model_timestep
    from trueflow.train.model import train_forward

    probe = ParityProbe(ProbeSpec(random_size="one_block", batch=4, text_len=7, resolution=16))
    engine = probe.build_engine("qwen_image")
    i = probe.inputs
    with torch.no_grad():
        rollout = engine(hidden_states=i["hidden_states"], timestep=i["timestep"], grid=i["grid"], **i["cond"])
        ts = model_timestep(i["timestep"], torch.bfloat16)
        singles = [train_forward(probe.family, probe.train, i["hidden_states"][s:s + 1], ts[s:s + 1], i["grid"],
                                 {"encoder_hidden_states": i["cond"]["encoder_hidden_states"][s:s + 1]})
                   for s in range(4)]
    assert torch.equal(rollout, probe.train_output)  # micro-batch == microgroup: bitwise
    assert not torch.equal(rollout, torch.cat(singles))  # four micro-batches of 1: not


def test_kl_to_the_base_keeps_parity(tmp_path, tiny_checkpoint):
    """--kl-beta runs the LoRA-disabled base beside the policy: zero KL before the first update (B = 0 makes them
    one model), positive after it, and the policy forward stays bitwise with the engine."""
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), checkpoint=str(tiny_checkpoint), **{**BASE, "num_rollouts": 2},
                      kl_beta=0.1)
    run_training(cfg)
    first, second = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert first["kl"] == 0.0 and second["kl"] > 0
    assert first["model_output_max_abs_diff"] == 0.0 and second["model_output_max_abs_diff"] == 0.0
