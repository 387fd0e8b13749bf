"""The training options against their formulas, in tiny runs: off-policy steps (the policy's change in policy_*,
the mismatch null or measured against the kept rolled-out weights), GRPO-Guard, DiffusionNFT, the lr schedule, the
EMA of the LoRA, and what existed before them (no CFG, global std, the SDE window). Oracles are float64 formulas
from the papers, fed with the tensors the engine recorded (debug snapshots) and rewards fixed by the test."""

from __future__ import annotations

import json
import math
import shutil
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trueflow.train.config import TrainConfig, config_from_argv, resume_changes
from trueflow.train.metrics import read_metrics
from trueflow.train.schedule import WeightsEMA
from test_train import FAST, comparable, train

MISMATCH = ("model_output_max_abs_diff", "model_output_mean_abs_diff", "log_prob_max_abs_diff", "ratio_mean",
            "ratio_max_abs_dev_from_1")
REWARDS = np.array([0.0, 1.0, 4.0, 9.0, 0.0, 10.0, 40.0, 90.0])  # two groups of 4, spreads 10x apart
FIXED = "test_algorithms:fixed_reward"


def fixed_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return torch.tensor(REWARDS[:len(images)], dtype=torch.float32)


def url_reward(url: str):
    """A reward factory that takes the run's --reward-url: it scores every image len(url)."""
    return lambda images, prompts: torch.full((len(images),), float(len(url)))


def nan_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return torch.full((len(images),), math.nan)


def advantages64(global_std: bool, clip: float = 5.0) -> np.ndarray:
    """flow-GRPO's advantages in float64: (r − group mean) / (std + 1e-4), population std of the group or of all."""
    groups = REWARDS.reshape(-1, 4)
    std = np.std(REWARDS) if global_std else np.std(groups, axis=1, keepdims=True)
    return np.clip((groups - groups.mean(axis=1, keepdims=True)) / (std + 1e-4), -clip, clip).reshape(-1)


def snapshot_pairs(run) -> list[dict]:
    """Every trained (sample, step) pair of rollout 0, from its debug snapshot, in float64."""
    path = run / "snapshots" / "rollout-00000.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = json.loads(next(v for k, v in f.metadata().items() if k != "format"))
    pairs = []
    for m, mg in enumerate(meta["microgroups"]):
        sigmas = tensors[f"mg{m}/sigmas"].double()
        for t in mg["sde_steps"]:
            for i, sample in enumerate(mg["sample_indices"]):
                pairs.append({"sample": sample, "sigma": sigmas[t].item(), "dt": (sigmas[t + 1] - sigmas[t]).item(),
                              "x_t": tensors[f"mg{m}/step{t}/latents"][i].double(),
                              "x0": tensors[f"mg{m}/final_latents"][i].double(),
                              "v": tensors[f"mg{m}/step{t}/guided_output"][i].double()})
    return pairs


# -- off-policy steps (issue J.3) --------------------------------------------------------------------------------
OFF_POLICY = dict(num_rollouts=1, num_steps_per_rollout=2, lr=0.05, sample_every=0)


def test_a_second_step_shows_the_policys_change_not_a_mismatch(tmp_path, tiny_checkpoint):
    first, second = train(tmp_path, tiny_checkpoint, **OFF_POLICY)
    assert all(first[k] == v for k, v in zip(MISMATCH, (0.0, 0.0, 0.0, 1.0, 0.0))) and first["parity_measured"]
    assert first["policy_ratio_mean"] == 1.0 and first["clip_frac"] == 0.0
    assert all(second[k] is None for k in MISMATCH) and not second["parity_measured"]
    assert second["clip_frac"] > 0 and second["policy_ratio_mean"] != 1.0
    assert second["policy_ratio_max_abs_dev_from_1"] > 1e-4 and second["policy_log_prob_max_abs_diff"] > 0


def test_parity_on_every_step_measures_against_the_rolled_out_weights(tmp_path, tiny_checkpoint):
    first, second = train(tmp_path, tiny_checkpoint, **OFF_POLICY, parity_on_every_step=True)
    for row in (first, second):
        assert [row[k] for k in MISMATCH] == [0.0, 0.0, 0.0, 1.0, 0.0] and row["parity_measured"]
    assert second["clip_frac"] > 0 and second["policy_log_prob_max_abs_diff"] > 0
    # The kept weights were swapped back: the second step trained the moved policy, so its update differs.
    assert second["lora_update_norm"] > 0 and second["policy_ratio_mean"] != 1.0


# -- GRPO-Guard (arXiv 2510.22319) -------------------------------------------------------------------------------
@pytest.mark.parametrize("global_std", [False, True])
def test_grpo_guard_loss_is_the_reweighted_surrogate_on_policy(tmp_path, tiny_checkpoint, global_std):
    """On a rollout's first step RatioNorm's r̂ is exactly 1 (Eq. 8 with Δμ = 0), so the loss is Eq. 12's
    −mean(A/|Δt|) over the pairs; without the 1/|Δt| weight it would be −mean(A) = 0 (each group sums to 0).
    The advantages take the per-group or the global std (the global-std setting's test)."""
    rows = train(tmp_path, tiny_checkpoint, num_rollouts=1, rollout_microgroup_size=2, micro_batch_size_sample=2,
                 reward=FIXED, ratio_norm="grpo_guard", global_std=global_std, debug=True, sample_every=0)
    pairs = snapshot_pairs(tmp_path / "run")
    assert len({p["dt"] for p in pairs}) > 1, "the microgroups' windows differ: the weights matter"
    adv = advantages64(global_std)
    expected = -np.mean([adv[p["sample"]] / abs(p["dt"]) for p in pairs])
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5) and abs(expected) > 1e-3
    assert rows[0]["ratio_mean"] == 1.0 and rows[0]["model_output_max_abs_diff"] == 0.0


def test_grpo_guard_off_policy_step_runs(tmp_path, tiny_checkpoint):
    _, second = train(tmp_path, tiny_checkpoint, **OFF_POLICY, ratio_norm="grpo_guard")
    assert math.isfinite(second["loss"]) and second["clip_frac"] > 0


# -- DiffusionNFT (arXiv 2509.16117) -----------------------------------------------------------------------------
@pytest.mark.parametrize("adaptive", [True, False])
def test_nft_loss_is_the_papers_on_the_recorded_tensors(tmp_path, tiny_checkpoint, adaptive):
    """On the first step the policy is the old one: v = v_old = the engine's recorded output (bitwise parity), so
    v⁺ = v⁻ = v_old and Eq. 5's loss is L(v_old)/β, with x_t the recorded latent = (1 − σ)·x0 + σ·ε, x0 the
    trajectory's clean end, L the self-normalised x0 regression (Sec. 3.3) or the velocity MSE (Eq. 1)."""
    beta = 0.5
    rows = train(tmp_path, tiny_checkpoint, num_rollouts=1, algorithm="nft", cfg_scale=1.0, nft_beta=beta,
                 nft_adaptive_weight=adaptive, reward=FIXED, debug=True, sample_every=0)
    losses = []
    for p in snapshot_pairs(tmp_path / "run"):
        noise = (p["x_t"] - (1 - p["sigma"]) * p["x0"]) / p["sigma"]
        if adaptive:
            err = p["x_t"] - p["sigma"] * p["v"] - p["x0"]
            loss = (err**2).mean() / max(err.abs().mean().item(), 1e-5)
        else:
            loss = ((p["v"] - (noise - p["x0"])) ** 2).mean()
        losses.append(float(loss) / beta)
    assert rows[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert rows[0]["model_output_max_abs_diff"] == 0.0 and rows[0]["clip_frac"] is None
    assert rows[0]["lora_update_norm"] > 0


def test_nft_trains_off_policy_with_any_sampler(tmp_path, tiny_checkpoint):
    _, second = train(tmp_path, tiny_checkpoint, **OFF_POLICY, algorithm="nft", cfg_scale=1.0, sampler="cps")
    assert math.isfinite(second["loss"]) and second["lora_update_norm"] > 0 and second["clip_frac"] is None


@pytest.mark.parametrize("overrides, fix", [
    (dict(ratio_norm="grpo_guard", sampler="cps"), "needs --sampler sde"),
    (dict(algorithm="nft"), "set --cfg-scale 1"),
    (dict(algorithm="nft", cfg_scale=1.0, kl_beta=0.1), "set --kl-beta 0"),
    (dict(lr_warmup_steps=3), "--lr-warmup-steps 3 must be less than"),
])
def test_combinations_that_cannot_work_are_refused(overrides, fix):
    with pytest.raises(ValueError, match=fix):
        TrainConfig(num_rollouts=3, **overrides)


def test_the_algorithm_flags():
    cfg = config_from_argv(["--algorithm", "nft", "--cfg-scale", "1", "--ratio-norm", "none", "--lr-schedule",
                            "cosine", "--lr-warmup-steps", "1", "--ema-decay", "0.9", "--parity-on-every-step",
                            "--reward-url", "http://127.0.0.1:9/v1"])
    assert (cfg.algorithm, cfg.lr_schedule, cfg.lr_warmup_steps, cfg.ema_decay) == ("nft", "cosine", 1, 0.9)
    assert cfg.parity_on_every_step and cfg.reward_url == "http://127.0.0.1:9/v1"
    assert config_from_argv(["--algorithm.name", "nft", "--rollout.cfg-scale", "1"]).algorithm == "nft"


# -- lr schedule (SGDR, arXiv 1608.03983, Eq. 5) -----------------------------------------------------------------
def closed_form_lr(kind: str, base: float, k: int, warmup: int, total: int) -> float:
    """Linear warmup from 0, then SGDR's Eq. 5 (η_min = 0, one cycle over the post-warmup steps) or linear decay."""
    if k < warmup:
        return base * k / warmup
    p = (k - warmup) / (total - warmup)
    return base * {"constant": 1.0, "linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p))}[kind]


def test_the_lr_of_every_step_of_a_run_is_the_closed_form(tmp_path, tiny_checkpoint):
    base, warmup, total = 0.01, 2, 6
    rows = train(tmp_path, tiny_checkpoint, num_rollouts=3, num_steps_per_rollout=2, lr=base, lr_schedule="cosine",
                 lr_warmup_steps=warmup, sample_every=0)
    for r in rows:
        assert r["lr"] == pytest.approx(closed_form_lr("cosine", base, r["step"] - 1, warmup, total), rel=1e-12,
                                        abs=1e-15)
    assert rows[0]["lr"] == 0.0 and rows[2]["lr"] == base


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_the_scheduler_follows_the_closed_form(kind):
    from trueflow.train.schedule import lr_scheduler

    base, warmup, total = 0.3, 3, 11
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = lr_scheduler(optimizer, total, warmup, kind)
    for k in range(total):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(closed_form_lr(kind, base, k, warmup, total),
                                                                rel=1e-12, abs=1e-15)
        optimizer.step()
        scheduler.step()


def test_a_decaying_schedule_refuses_a_longer_resume():
    saved = TrainConfig(num_rollouts=3, lr_schedule="cosine").to_dict()
    refused, _ = resume_changes(saved, TrainConfig(num_rollouts=5, lr_schedule="cosine"))
    assert any("--rollout.num-rollouts 5" in line for line in refused)
    assert resume_changes({**saved, "lr_schedule": "constant"}, TrainConfig(num_rollouts=5)) == ([], [])


# -- EMA of the LoRA ---------------------------------------------------------------------------------------------
def test_ema_of_a_constant_update_is_the_closed_form():
    """e_k = d·e_{k−1} + (1 − d)·θ_k from e_0 = θ_0 with θ_k = θ_0 + k·u:
    e_k = θ_0 + u·(k − d(1 − d^k)/(1 − d))."""
    d, k = 0.9, 7
    theta = {"w": torch.nn.Parameter(torch.tensor([1.0, -2.0]))}
    u = torch.tensor([0.5, 0.25])
    ema = WeightsEMA(theta, d)
    for _ in range(k):
        with torch.no_grad():
            theta["w"].add_(u)
        ema.update(theta)
    expected = np.array([1.0, -2.0]) + np.array([0.5, 0.25]) * (k - d * (1 - d**k) / (1 - d))
    np.testing.assert_allclose(ema.full_state()["w"].numpy(), expected, rtol=1e-6)


def test_ema_and_schedule_are_checkpointed_and_resume_exactly(tmp_path, tiny_checkpoint):
    d = 0.5
    settings = dict(num_rollouts=3, save_every=1, lr_schedule="cosine", lr_warmup_steps=1, ema_decay=d)
    rows = train(tmp_path / "a", tiny_checkpoint, **settings)
    ckpts = tmp_path / "a" / "run" / "checkpoints"
    step = {k: load_file(str(ckpts / f"step-{k:06d}" / "pytorch_lora_weights.safetensors")) for k in (2, 3)}
    ema = {k: load_file(str(ckpts / f"step-{k:06d}" / "pytorch_lora_weights_ema.safetensors")) for k in (2, 3)}
    for name in step[3]:  # the EMA update after step 3, from step 2's EMA and step 3's weights
        np.testing.assert_allclose(ema[3][name].double(), d * ema[2][name].double() + (1 - d) * step[3][name].double(),
                                   rtol=1e-6, atol=1e-9)
    assert any(not torch.equal(ema[3][n], step[3][n]) for n in step[3])
    assert (tmp_path / "a" / "run" / "samples" / "rollout-00000-ema.png").is_file()
    # Resume from step 2: the rest of the run is the same, bit for bit (lr, weights, EMA).
    shutil.copytree(tmp_path / "a" / "run", tmp_path / "b" / "run")
    shutil.rmtree(tmp_path / "b" / "run" / "checkpoints" / "step-000003")
    (tmp_path / "b" / "run" / "checkpoints" / "latest").write_text("step-000002\n")
    resumed = train(tmp_path / "b", tiny_checkpoint, **settings, resume=True)
    assert comparable(resumed) == comparable(rows)
    again = tmp_path / "b" / "run" / "checkpoints" / "step-000003"
    for f, ref in (("pytorch_lora_weights.safetensors", step[3]), ("pytorch_lora_weights_ema.safetensors", ema[3])):
        got = load_file(str(again / f))
        assert all(torch.equal(got[n], ref[n]) for n in ref)


# -- what existed before: no CFG, the random SDE window ----------------------------------------------------------
def test_training_without_cfg_runs_one_branch_bitwise(tmp_path, tiny_checkpoint):
    rows = train(tmp_path, tiny_checkpoint, num_rollouts=2, cfg_scale=1.0, debug=True, sample_every=0)
    assert all(r["model_output_max_abs_diff"] == 0.0 and r["lora_update_norm"] > 0 for r in rows)
    tensors = load_file(str(tmp_path / "run" / "snapshots" / "rollout-00000.safetensors"))
    assert not any("negative" in k for k in tensors), "no negative branch ran"


def test_the_sde_window_holds_every_trained_step(tmp_path, tiny_checkpoint):
    train(tmp_path, tiny_checkpoint, num_rollouts=1, steps=4, sde_window=(2, 3), rollout_microgroup_size=2,
          micro_batch_size_sample=2, debug=True, sample_every=0)
    assert {round(p["sigma"], 6) for p in snapshot_pairs(tmp_path / "run")} == {
        round(load_file(str(tmp_path / "run" / "snapshots" / "rollout-00000.safetensors"))["mg0/sigmas"][2].item(), 6)}


# -- the reward URL and a failing reward in the engine process ----------------------------------------------------
@pytest.mark.parametrize("engine_process", [False, True])
def test_the_reward_url_reaches_the_reward(tmp_path, tiny_checkpoint, engine_process):
    url = "http://127.0.0.1:9/v1"
    placement = dict(engine_process=True, reward_placement="engine") if engine_process else {}
    (row,) = train(tmp_path, tiny_checkpoint, num_rollouts=1, reward="test_algorithms:url_reward", reward_url=url,
                   sample_every=0, **placement)
    assert row["reward_mean"] == len(url)


@pytest.mark.parametrize("spec, says", [("test_algorithms:nan_reward", "returned nan"),
                                         ("no_such_reward", "no_such_reward")])
def test_a_failing_reward_in_the_engine_process_is_one_line(tmp_path, tiny_checkpoint, capsys, spec, says):
    """A reward that fails on a rollout, or a spec that cannot be built, in the engine process: one line, exit 2."""
    from trueflow.cli import main

    argv = ["train", "--checkpoint", str(tiny_checkpoint), "--output-dir", str(tmp_path / "run"), "--steps", "3",
            "--num-rollouts", "1", "--engine-process", "--reward-placement", "engine", "--reward", spec]
    assert main(argv) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "trueflow train: error:" in x]  # after the progress bar's last draw
    assert says in line and "Traceback" not in err


def test_a_rollout_whose_every_reward_is_skipped_logs_null_without_a_warning(tmp_path, tiny_checkpoint):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (row,) = train(tmp_path, tiny_checkpoint, num_rollouts=1, reward="test_algorithms:nan_reward",
                       reward_on_error="skip", sample_every=0)
    assert not [w for w in caught if "degrees of freedom" in str(w.message)]
    assert row["reward_mean"] is None and row["reward_std"] is None and row["dropped_samples"] == 8


def test_cudnn_attention_is_refused_on_cpu_before_loading():
    with pytest.raises(ValueError, match="_native_cudnn needs a CUDA device"):
        TrainConfig(fsdp_attention_backend="_native_cudnn").validate()


def test_tensorboard_events_hold_the_step_scalars(tmp_path):
    """The `tensorboard` extra: `--tensorboard` writes each record's numbers as scalars, at the record's step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trueflow.train.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb")
    for step in (1, 2):
        writer.write({"step": step, "loss": 0.5 * step, "model_output_max_abs_diff": None})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 1.0)]
    assert "model_output_max_abs_diff" not in events.Tags()["scalars"]  # null is not charted as a number


def test_the_cudnn_backend_pairs_the_engine_group():
    """Condition 5: plain qwen_image follows the train side's attention backend where the engine has its kernel."""
    cudnn = TrainConfig(fsdp_attention_backend="_native_cudnn")
    assert cudnn.engine_patch_group() == "qwen_image:_native_cudnn"
    assert not [w for w in cudnn.parity_warnings() if "condition 5" in w]
    math_backend = TrainConfig(fsdp_attention_backend="_native_math")
    assert math_backend.engine_patch_group() == "qwen_image"
    assert [w for w in math_backend.parity_warnings() if "condition 5" in w]
    mismatched = TrainConfig(rollout_patch_group="qwen_image:_native_cudnn")
    assert [w for w in mismatched.parity_warnings() if "condition 5" in w]


def test_the_nft_recipe_loads_and_breaks_no_condition():
    """Its second optimizer step per rollout is measured against the rolled-out LoRA (--parity-on-every-step), so
    condition 1 holds for what it guards, the measured mismatch; without the flag that step goes unmeasured."""
    cfg = config_from_argv(["--config", "recipes/diffusion-nft.yaml"])
    assert (cfg.algorithm, cfg.cfg_scale, cfg.lr_schedule, cfg.parity_on_every_step) == ("nft", 1.0, "cosine", True)
    assert cfg.num_steps_per_rollout == 2 and cfg.parity_warnings() == []
    unmeasured = config_from_argv(["--config", "recipes/diffusion-nft.yaml", "--no-parity-on-every-step"])
    assert [w.split(":")[0] for w in unmeasured.parity_warnings()] == ["condition 1"]


@pytest.mark.slow
def test_the_kept_copy_on_two_fsdp_ranks(tiny_checkpoint, tmp_path):
    """The kept rolled-out LoRA is swapped into FSDP2's sharded parameters on each rank: step 2's mismatch is still
    exactly 0.0 there, while the policy moved."""
    import os
    import subprocess
    import sys

    from test_train import cli_flags
    from trueflow.net import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "trueflow", "train", "--checkpoint", str(tiny_checkpoint),
           "--output-dir", str(tmp_path / "run"), "--num-rollouts", "1", "--num-steps-per-rollout", "2",
           "--lr", "0.05", "--parity-on-every-step", *cli_flags(**{**FAST, "sample_every": 0})]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for row in (first, second):
        assert [row[k] for k in MISMATCH] == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert second["clip_frac"] > 0 and second["policy_log_prob_max_abs_diff"] > 0


def test_the_reward_verb_takes_a_url(tmp_path, capsys):
    from PIL import Image

    from trueflow.cli import main

    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    url = "http://127.0.0.1:9/v1"
    assert main(["reward", "--name", "test_algorithms:url_reward", "--url", url, "--image", str(tmp_path / "x.png"),
                 "--prompt", "p"]) == 0
    assert float(capsys.readouterr().out) == len(url)
