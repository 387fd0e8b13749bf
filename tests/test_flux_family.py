"""FLUX.1-dev through the generic code, as a user runs it: `parity` (bitwise under the `flux` group with and without
LoRA and with true CFG, not without the group, the ablation naming each patch), `generate` (PNGs, and a snapshot
whose steps diffusers alone replays bit for bit), `train` (0.0 at every step, the LoRA moving, the recorded run
reproduced), FLUX without a negative prompt given `--cfg-scale` (refused in one line), the other refusals, the
recipe, and the GPU script's CPU smoke path."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import assert_matches_recorded_run, replay_snapshot_step
from trueflow.cli import main
from trueflow.engine.sampling_params import SamplingParams, check_family_limits
from trueflow.models import get_family

FLUX = get_family("flux")
REPLAY = "replay_flux_step.py"
SMALL = ["--max-sequence-length", "16"]


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _parity(capsys, checkpoint, *extra) -> dict:
    rc, out, err = _run(capsys, "parity", "--checkpoint", str(checkpoint), "--batch", "2", "--json", *extra)
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _one_line_error(capsys, *argv) -> str:
    rc, _, err = _run(capsys, *argv)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_parity_is_bitwise_under_the_flux_group_and_not_without(flux_checkpoint, capsys):
    """Without LoRA, with an unmerged LoRA (the ablation: every patch off alone), and a true-CFG step."""
    on = _parity(capsys, flux_checkpoint, "--patch-group", "flux")
    assert on["bitwise_equal"] and on["model_output_max_abs_diff"] == 0.0, on
    assert on["train_attention_backend"] == "_native_flash" and on["engine_attention_backend"] == "flash"
    assert all(r["max_abs_diff"] == 0.0 for r in on["layers"]) and len(on["layers"]) > 50
    off = _parity(capsys, flux_checkpoint, "--patch-group", "none")
    assert not off["bitwise_equal"] and off["model_output_max_abs_diff"] > 0, off
    # with an unmerged LoRA: the group (0.0), each patch off alone, no group (non-zero)
    lora = _parity(capsys, flux_checkpoint, "--patch-group", "flux", "--lora-rank", "8", "--ablate")
    assert lora["bitwise_equal"] and lora["model_output_max_abs_diff"] == 0.0, lora
    ablation = lora["ablation"]
    diffs = {r["disabled_patches"][0] if r["disabled_patches"] else r["patch_group"]: r["model_output_max_abs_diff"]
             for r in ablation}
    assert set(diffs) == {*FLUX.patch_groups["flux"].group.patch_names, "flux", "none"}
    assert diffs["flux"] == 0.0 and diffs["none"] > 0
    # what each numerics patch buys on this CPU (the kernel pins and the fp64 tables show nothing at this size)
    for name in ("layer_norm_scale_shift", "scale_residual_layer_norm_scale_shift", "gated_residual",
                 "qk_norm_rope", "contiguous_split", "timestep_dtype", "lora_unmerged"):
        assert diffs[name] > 0, f"switching {name} off changed nothing"
    cfg = _parity(capsys, flux_checkpoint, "--patch-group", "flux", "--lora-rank", "4", "--cfg-scale", "4")
    assert cfg["bitwise_equal"] and cfg["model_output_max_abs_diff"] == 0.0, cfg


def _generate(checkpoint, out: Path, group: str, *extra: str) -> Path:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "a red apple", "--num-images", "2",
                     "--resolution", "64", "--steps", "3", "--sampler", "sde", "--patch-group", group, *SMALL,
                     *extra, "--snapshot", str(out / "s.safetensors"), "--out", str(out)]) == 0
    return out / "s.safetensors"


def test_generate_writes_images_and_a_snapshot_diffusers_replays(flux_checkpoint, tmp_path):
    """True CFG (a negative prompt, scale 3) so that the replay runs both of FluxPipeline's calls; the distilled
    scale is a recorded input of both branches."""
    from PIL import Image

    snapshot = _generate(flux_checkpoint, tmp_path / "on", "flux", "--cfg-scale", "3", "--negative-prompt", "blurry",
                         "--distilled-guidance-scale", "4")
    for i in range(2):
        with Image.open(tmp_path / "on" / f"{i:04d}.png") as image:
            assert image.size == (64, 64)
    tensors = load_file(str(snapshot))
    assert torch.equal(tensors["mg0/positive/guidance"], torch.full((2,), 4.0))
    assert torch.equal(tensors["mg0/negative/guidance"], torch.full((2,), 4.0))
    with safe_open(str(snapshot), "pt") as f:
        meta = json.loads(f.metadata()["trueflow"])
    assert meta["params"]["negative_prompt"] == "blurry" and meta["microgroups"][0]["cfg_scales"] == [3.0] * 3
    for t in (0, 2):
        assert replay_snapshot_step(snapshot, 0, t, REPLAY) == {"microgroup": 0, "step": t, "bitwise_equal": True,
                                                                "max_abs_diff": 0.0}
    # the failing side: the engine's fast numerics are not diffusers'
    off = _generate(flux_checkpoint, tmp_path / "off", "none", "--cfg-scale", "1")
    assert replay_snapshot_step(off, 0, 1, REPLAY)["bitwise_equal"] is False


def test_flux_without_a_negative_prompt_given_cfg_is_refused_in_one_line(flux_checkpoint, tmp_path, capsys,
                                                                         monkeypatch):
    """FluxPipeline runs true CFG only with `true_cfg_scale > 1` AND a negative prompt, and has none by default: the
    family's default negative prompt is none, so `--cfg-scale 4` alone is refused, naming both fixes."""
    monkeypatch.chdir(tmp_path)
    for verb in (["generate", "--checkpoint", str(flux_checkpoint), "--prompt", "a cat", "--out", "g"],
                 ["train", "--checkpoint", str(flux_checkpoint), "--output-dir", "r"]):
        line = _one_line_error(capsys, *verb, "--cfg-scale", "4")
        assert "flux runs classifier-free guidance only with a negative prompt" in line
        assert "--negative-prompt TEXT" in line and "--cfg-scale) to 1" in line
    with pytest.raises(ValueError, match="only with a negative prompt"):
        check_family_limits(SamplingParams(cfg_scale=4.0), FLUX)
    check_family_limits(SamplingParams(cfg_scale=4.0, negative_prompt=""), FLUX)  # an empty prompt is a prompt
    check_family_limits(SamplingParams(cfg_scale=1.0), FLUX)  # the pipeline's default: distilled guidance alone
    check_family_limits(SamplingParams(cfg_scale=4.0), get_family("qwen_image"))  # Qwen-Image's default is " "
    # and the family's other limits, one line each
    for argv, match in ((["--resolution", "40"], "multiple of 16"),
                        (["--max-sequence-length", "600"], "max_sequence_length must be in 1..512"),
                        (["--num-frames", "2"], "FLUX.1 makes images")):
        assert match in _one_line_error(capsys, "generate", "--checkpoint", str(flux_checkpoint), "--prompt", "a",
                                        "--cfg-scale", "1", "--out", "g", *argv)
    assert "--tp 3 does not divide the 2 attention heads" in _one_line_error(
        capsys, "parity", "--checkpoint", str(flux_checkpoint), "--patch-group", "flux", "--tp", "3")


def test_train_is_bitwise_at_every_step(flux_checkpoint, tmp_path, capsys):
    """2 rollouts of the recipe's kind (distilled guidance, no true CFG, SDE window): 0.0 at every step, the LoRA
    moving on both block kinds and loadable in FluxPipeline, the recorded run reproduced bit for bit, the distilled
    scale recorded with the rollouts."""
    from diffusers import FluxPipeline

    from trueflow.train.checkpoint import LORA_FILE, latest_checkpoint
    from trueflow.train.metrics import read_metrics

    run = tmp_path / "run"
    rc, _, err = _run(capsys, "train", "--checkpoint", str(flux_checkpoint), "--output-dir", str(run), "--debug",
                      "--num-rollouts", "2", "--rollout.batch-size", "1", "--n-samples-per-prompt", "2",
                      "--rollout.microgroup-size", "2", "--micro-batch-size-sample", "2", "--steps", "3",
                      "--num-sde-steps", "2", "--cfg-scale", "1", "--resolution", "32", "--sample-every", "1",
                      "--lr", "0.05", "--lora-rank", "4", *SMALL)
    assert rc == 0, err
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["log_prob_max_abs_diff"] == 0.0, r
        assert r["lora_update_norm"] > 0 and r["checksums_equal"] and r["policy_ratio_mean"] == 1.0, r
    assert_matches_recorded_run(run, "flux_train")
    saved = load_file(latest_checkpoint(run) / LORA_FILE)
    assert {k.split(".")[1] for k in saved} == {"transformer_blocks", "single_transformer_blocks"}
    assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
    FluxPipeline.from_pretrained(flux_checkpoint).load_lora_weights(latest_checkpoint(run))
    snapshot = run / "snapshots" / "rollout-00001.safetensors"
    with safe_open(str(snapshot), "pt") as f:
        meta = json.loads(f.metadata()["trueflow"])
    assert meta["params"]["negative_prompt"] is None and meta["guidance"]["distilled_input"] == "guidance"
    assert torch.equal(load_file(str(snapshot))["mg0/positive/guidance"], torch.full((2,), 3.5))  # the default


def test_the_flux_recipe_loads_aligned():
    """recipes/flux-dev.yaml: flow_grpo's pickscore_flux values, every parity condition kept."""
    from trueflow.train.config import config_from_argv

    cfg = config_from_argv(["--config", "recipes/flux-dev.yaml", "--family", "flux"])
    assert (cfg.steps, cfg.noise_level, cfg.n_samples_per_prompt, cfg.rollout_batch_size) == (6, 0.9, 24, 48)
    assert (cfg.cfg_scale, cfg.distilled_guidance_scale, cfg.max_sequence_length) == (1.0, 3.5, 128)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.kl_beta, cfg.global_std, cfg.reward) == (64, 128, 0.0, True,
                                                                                          "pickscore")
    cfg.fill_family_defaults()
    assert cfg.rollout_patch_group == "flux" and cfg.lora_target_modules == list(FLUX.train.lora_targets)
    assert cfg.parity_warnings() == []


def test_the_gpu_script_runs_its_cpu_smoke_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "scripts"))
    import gpu_flux

    out = tmp_path / "flux.json"
    assert gpu_flux.main(["--size", "tiny", "--device", "cpu", "--shapes", "32x1", "--speed-shapes", "32x1",
                          "--text-len", "8", "--warmup", "1", "--reps", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["parity"]) == 6 and {r["row"] for r in report["speed"]} == {
        "diffusers_eager", "engine_parity", "engine_fast"}
    sys.modules.pop("gpu_flux", None)
