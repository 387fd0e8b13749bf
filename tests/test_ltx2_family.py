"""LTX-2.3 through the generic code, as a user runs it: `init-checkpoint --family ltx2`, `parity` (bitwise under
the `ltx` group, not without it), `generate` (playable MP4s of the requested frames, and a snapshot whose step
diffusers alone replays bit for bit) and `train` (0.0 at every step)."""

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
from trueflow.train.config import TrainConfig
from trueflow.train.metrics import read_metrics
from trueflow.train.run import run_training
from trueflow.video import read_frames

VIDEO = ["--num-frames", "9", "--resolution", "64"]


@pytest.fixture(scope="module")
def ltx(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ltx2") / "tiny"
    assert main(["init-checkpoint", "--family", "ltx2", "--size", "tiny", "--out", str(out)]) == 0
    return out


def _stdout(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


def _parity(ltx: Path, group: str) -> dict:
    return json.loads(_stdout(["parity", "--checkpoint", str(ltx), "--patch-group", group, "--batch", "2",
                               "--lora-rank", "8", "--json"]).strip().splitlines()[-1])


def test_parity_is_bitwise_under_the_ltx_group_and_not_without(ltx):
    on = _parity(ltx, "ltx")
    assert on["model_output_max_abs_diff"] == 0.0 and on["bitwise_equal"] and on["train_attention_backend"] == "native"
    off = _parity(ltx, "none")
    assert off["model_output_max_abs_diff"] > 0 and not off["bitwise_equal"]
    table = _stdout(["parity", "--checkpoint", str(ltx), "--patch-group", "ltx", "--ablate"])
    assert "rms_norm_scale_shift" in table and "lora_unmerged" in table


def _generate(ltx: Path, out: Path, group: str, fps: str = "24") -> Path:
    _stdout(["generate", "--checkpoint", str(ltx), "--prompt", "a red apple", "--num-images", "2", *VIDEO,
             "--steps", "3", "--sampler", "sde", "--cfg-scale", "1", "--patch-group", group, "--fps", fps,
             "--snapshot", str(out / "s.safetensors"), "--out", str(out)])
    return out / "s.safetensors"


def test_generate_writes_videos_and_a_snapshot_diffusers_replays(ltx, tmp_path):
    snapshot = _generate(ltx, tmp_path / "on", "ltx")
    for i in range(2):
        frames = read_frames(tmp_path / "on" / f"{i:04d}.mp4")
        assert frames.shape == (9, 64, 64, 3)  # exactly the requested frames, at the requested size
        assert (tmp_path / "on" / f"{i:04d}-frames.png").is_file()
    for t in (0, 2):
        assert replay_snapshot_step(snapshot, 0, t, script=1) == {"microgroup": 0, "step": t, "bitwise_equal": True,
                                                                  "max_abs_diff": 0.0}
    # the failing side: the engine's fast numerics are not diffusers'
    assert replay_snapshot_step(_generate(ltx, tmp_path / "off", "none"), 0, 1, script=1)["bitwise_equal"] is False
    # The frame rate is a model input (RoPE positions in seconds): another one gives other samples, which the replay,
    # reading the recorded fps, still reproduces bit for bit.
    slow = _generate(ltx, tmp_path / "slow", "ltx", fps="12")
    assert replay_snapshot_step(slow, 0, 2, script=1)["bitwise_equal"] is True
    assert not torch.equal(load_file(str(slow))["mg0/final_latents"], load_file(str(snapshot))["mg0/final_latents"])


def test_train_is_bitwise_at_every_step(ltx, tmp_path):
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), checkpoint=str(ltx), num_frames=9, fps=12.0, resolution=64,
                      steps=4, num_sde_steps=1, cfg_scale=1.0, num_rollouts=2, rollout_batch_size=2,
                      n_samples_per_prompt=4, rollout_microgroup_size=4, micro_batch_size_sample=4, sample_every=1,
                      debug=True)
    run_training(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["log_prob_max_abs_diff"] == 0.0, r
        assert r["lora_update_norm"] > 0 and r["checksums_equal"]
    assert cfg.rollout_patch_group == "ltx" and cfg.fsdp_attention_backend == "native"  # the family's pairing
    assert_matches_recorded_run(tmp_path / "run", "ltx2_train")
    assert read_frames(tmp_path / "run" / "samples" / "rollout-00000-p0.mp4").shape == (9, 64, 64, 3)
    with safe_open(str(tmp_path / "run" / "snapshots" / "rollout-00000.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["trueflow"])
    assert [mg["static"] for mg in meta["microgroups"]] == [{"fps": 12.0}] * 2  # the run's rate, on both sides


def test_the_train_backend_stays_on_the_train_model(tiny_checkpoint, ltx):
    """A train forward on `_native_flash` (Qwen-Image's pairing) leaves diffusers' process-wide default alone, so the
    LTX-2.3 pipeline's own masked attention (its text connectors) still runs in the same process."""
    from diffusers import LTX2Pipeline
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from trueflow.parity.probe import ParityProbe, ProbeSpec

    before = _AttentionBackendRegistry.get_active_backend()[0]
    probe = ParityProbe(ProbeSpec(checkpoint=str(tiny_checkpoint)))  # runs the train forward on _native_flash
    assert probe.train_backend == "_native_flash"
    assert _AttentionBackendRegistry.get_active_backend()[0] == before
    pipe = LTX2Pipeline.from_pretrained(ltx)
    embeds = pipe.encode_prompt("a red apple", do_classifier_free_guidance=False, max_sequence_length=64)[0]
    assert torch.isfinite(embeds).all()


def test_the_ltx23_recipe_loads_aligned():
    """recipes/ltx23.yaml: the public recipe's settings, every parity condition kept (a microgroup per micro-batch)."""
    from trueflow.train.config import config_from_argv

    cfg = config_from_argv(["--config", "recipes/ltx23.yaml", "--family", "ltx2"])
    assert (cfg.sampler, cfg.noise_level, cfg.steps, cfg.num_frames, cfg.clip_range) == ("cps", 0.8, 24, 57, 1e-5)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.reward, cfg.reward_frames) == (64, 128, "pickscore", 3)
    cfg.fill_family_defaults()
    assert cfg.parity_warnings() == []


@pytest.mark.parametrize("frames", ["10", "9,x", "0"])
def test_the_gpu_script_refuses_a_frame_count_in_one_line(frames, monkeypatch, capsys, tmp_path):
    """scripts/gpu_ltx2.py: a count the pipeline would not take (8k + 1 frames) stops before anything is built,
    with argparse's exit 2 and the fix, not a traceback minutes into a GPU call."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "scripts"))
    import gpu_ltx2

    monkeypatch.setattr(sys, "argv", ["gpu_ltx2.py", "--out", str(tmp_path / "r.json"), "--frames", frames,
                                      "--device", "cpu", "--size", "tiny", "--parts", "parity"])
    with pytest.raises(SystemExit) as stop:
        gpu_ltx2.main()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--frames {frames}" in err and "Traceback" not in err and not (tmp_path / "r.json").exists()
