"""`--deterministic`: the run turns on PyTorch's deterministic-algorithms mode and fixes the cuBLAS workspace before
any model is built. On the CPU every kernel the run uses is deterministic already, so the run's metrics equal an
ordinary run's bit for bit; what the mode changes on a GPU is recorded in benchmarks/RESULTS.md."""

from __future__ import annotations

import os

import pytest
import torch

from trueflow.train.metrics import TIMING_KEYS, read_metrics
from trueflow.train.run import run_training
from trueflow.train.config import TrainConfig

FAST = dict(steps=3, num_sde_steps=1, rollout_batch_size=2, n_samples_per_prompt=4, rollout_microgroup_size=4,
            micro_batch_size_sample=4, sample_every=0, num_rollouts=2)


@pytest.fixture
def restore_determinism():
    """The mode is process-wide: put back what the test process had."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1], before[2]
    if before[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[3]


def test_a_deterministic_run_sets_the_mode_and_keeps_the_numbers(tmp_path, tiny_checkpoint, restore_determinism):
    run_training(TrainConfig(output_dir=str(tmp_path / "plain"), checkpoint=str(tiny_checkpoint), **FAST))
    assert not torch.are_deterministic_algorithms_enabled()
    run_training(TrainConfig(output_dir=str(tmp_path / "det"), checkpoint=str(tiny_checkpoint), deterministic=True,
                             **FAST))
    assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    plain, det = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("plain", "det"))
    assert len(plain) == len(det) == 2
    for a, b in zip(plain, det):
        numbers = {k for k in a if k not in TIMING_KEYS}
        assert {k: a[k] for k in numbers} == {k: b[k] for k in numbers}
        assert b["model_output_max_abs_diff"] == 0.0 and b["lora_update_norm"] > 0


def test_deterministic_is_part_of_the_math_on_resume():
    from trueflow.train.config import resume_changes

    before = TrainConfig(deterministic=False).to_dict()
    refused, _ = resume_changes(before, TrainConfig(deterministic=True))
    assert any("deterministic" in line for line in refused)
