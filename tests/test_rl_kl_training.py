"""The KL penalty in a real CPS training run whose window holds the last step (σ_next = 0, where CPS is
deterministic): that pair is left out of the KL, so the KL and the loss stay finite (0/0 before the fix)."""

from __future__ import annotations

import math

import pytest


@pytest.mark.slow
def test_cps_kl_with_the_last_step_in_the_window(tmp_path, tiny_checkpoint):
    # Imported here: collecting this file must stay cheap for scripts/mutate_rl.py, which deselects this test.
    from trueflow.train.config import TrainConfig
    from trueflow.train.metrics import read_metrics
    from trueflow.train.run import run_training

    cfg = TrainConfig(output_dir=str(tmp_path / "run"), checkpoint=str(tiny_checkpoint), sampler="cps", steps=3,
                      num_sde_steps=3, kl_beta=0.1, rollout_batch_size=1, n_samples_per_prompt=4,
                      rollout_microgroup_size=4, micro_batch_size_sample=4, num_rollouts=2, sample_every=0)
    run_training(cfg)
    first, second = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert first["kl"] == 0.0 and second["kl"] > 0
    assert all(math.isfinite(m[k]) for m in (first, second) for k in ("loss", "kl", "grad_norm"))
    assert second["lora_update_norm"] > 0
