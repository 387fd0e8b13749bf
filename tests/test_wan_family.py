"""Wan2.2 through the generic code, as a user runs it, in both layouts: `init-checkpoint --family wan` (the two-expert
A14B and the dense TI2V-5B), `parity` (bitwise under the `wan` group on each expert, with and without LoRA, with CFG,
image-to-video on the TI2V-5B; not without the group), `generate` (MP4s of the requested frames, a snapshot whose
steps, on either expert, diffusers alone replays bit for bit), `train` (2 rollouts crossing the expert boundary: 0.0
at every step, both experts' LoRA moving and loadable by WanPipeline, the recorded run reproduced bit for bit; and the
TI2V-5B's per-token timesteps), the recipes, and the one-line refusals."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import assert_matches_recorded_run, replay_snapshot_step
from trueflow.cli import main
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.train.config import TrainConfig, config_from_argv
from trueflow.train.metrics import read_metrics
from trueflow.train.run import run_training
from trueflow.video import read_frames

WAN_REPLAY = "replay_wan_step.py"  # docs/snapshot.md's Wan script
SIZES = {"a14b": 32, "ti2v": 64}


def _stdout(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


def _one_line_error(capsys, *argv) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_init_checkpoint_writes_both_layouts(tmp_path, wan_a14b_checkpoint, wan_ti2v_checkpoint):
    out = tmp_path / "w"
    assert "wrote a tiny wan checkpoint" in _stdout(["init-checkpoint", "--family", "wan", "--size", "tiny",
                                                    "--output-dir", str(out)])
    a14b, ti2v = (json.loads((c / "model_index.json").read_text()) for c in (out, wan_ti2v_checkpoint))
    assert (a14b["boundary_ratio"], a14b["expand_timesteps"], a14b["transformer_2"]) == (
        0.875, False, ["diffusers", "WanTransformer3DModel"])
    assert (ti2v["boundary_ratio"], ti2v["expand_timesteps"], ti2v["transformer_2"]) == (None, True, [None, None])
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == \
        (wan_a14b_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()  # seeded
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() != \
        (out / "transformer_2" / "diffusion_pytorch_model.safetensors").read_bytes()  # two experts
    vae = json.loads((wan_ti2v_checkpoint / "vae" / "config.json").read_text())
    assert (vae["z_dim"], vae["scale_factor_spatial"], vae["is_residual"]) == (48, 16, True)
    from trueflow.models import checkpoint_experts, family_for_checkpoint

    layout = family_for_checkpoint(wan_ti2v_checkpoint)
    assert (layout.name, layout.pipeline.pixels_per_token, layout.pipeline.image_cond is not None) == ("wan", 32, True)
    assert family_for_checkpoint(out).pipeline.pixels_per_token == 16
    assert [e.name for e in checkpoint_experts(out, layout)] == ["transformer", "transformer_2"]


# -- parity ------------------------------------------------------------------------------------------------------------
PARITY = {  # (layout, expert, LoRA rank, CFG scale)
    "a14b-transformer": ("a14b", "transformer", 0, 1.0),
    "a14b-transformer_2-lora-cfg": ("a14b", "transformer_2", 8, 4.0),
    "ti2v-i2v-lora": ("ti2v", None, 8, 1.0),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_parity_is_bitwise_under_the_wan_group_and_not_without(case, wan_a14b_checkpoint, wan_ti2v_checkpoint):
    layout, expert, rank, cfg = PARITY[case]
    checkpoint = wan_a14b_checkpoint if layout == "a14b" else wan_ti2v_checkpoint
    probe = ParityProbe(ProbeSpec(checkpoint=str(checkpoint), expert=expert, batch=2, lora_rank=rank,
                                  cfg_scale=cfg, resolution=SIZES[layout]))
    if layout == "ti2v":  # an image-to-video step: first-frame latents, per-token timesteps of two values
        assert "image_latents" in probe.inputs["cond"] and len(probe.inputs["timestep"].unique()) == 2
    exact = probe.run("wan")[0]
    assert exact.bitwise_equal and exact.model_output_max_abs_diff == 0.0 and exact.train_attention_backend == \
        "_native_flash"
    assert exact.layers and all(r.max_abs_diff == 0.0 for r in exact.layers)
    fast = probe.run("none")[0]
    assert fast.model_output_max_abs_diff > 0 and not fast.bitwise_equal


def test_parity_cli_and_ablation(wan_a14b_checkpoint):
    """The CLI on the second expert with a LoRA, and the ablation: the whole group bitwise, each patch switched off
    alone named in the table, no group not bitwise."""
    from trueflow.models.wan.patches import GROUP

    out = json.loads(_stdout(["parity", "--checkpoint", str(wan_a14b_checkpoint), "--patch-group", "wan",
                              "--expert", "transformer_2", "--batch", "2", "--lora-rank", "8", "--resolution", "32",
                              "--ablate", "--json"]).strip().splitlines()[-1])
    assert out["expert"] == "transformer_2" and out["model_output_max_abs_diff"] == 0.0 and out["bitwise_equal"]
    runs = out["ablation"]
    assert [r["disabled_patches"] for r in runs[1:-1]] == [[p] for p in GROUP.patch_names]
    assert runs[0]["bitwise_equal"] and runs[-1]["patch_group"] == "none" and not runs[-1]["bitwise_equal"]
    # at this size qk_norm_rope and the unmerged LoRA each show on their own
    off = {r["disabled_patches"][0] for r in runs[1:-1] if not r["bitwise_equal"]}
    assert {"qk_norm_rope", "lora_unmerged"} <= off


# -- generate ----------------------------------------------------------------------------------------------------------
def _generate(checkpoint: Path, out: Path, group: str, *extra: str, images: int = 2) -> Path:
    size = str(SIZES["ti2v" if "ti2v" in checkpoint.name else "a14b"])
    _stdout(["generate", "--checkpoint", str(checkpoint), "--prompt", "a red apple", "--n-samples-per-prompt",
             str(images), "--num-frames", "5", "--resolution", size, "--steps", "2", "--sampler", "sde",
             "--cfg-scale", "4", "--patch-group", group, "--snapshot", str(out / "s.safetensors"), "--output-dir",
             str(out), *extra])
    return out / "s.safetensors"


def test_generate_writes_videos_and_a_snapshot_diffusers_replays(wan_a14b_checkpoint, wan_ti2v_checkpoint, tmp_path):
    snapshot = _generate(wan_a14b_checkpoint, tmp_path / "on", "wan", "--cfg-scale-2", "3")
    for i in range(2):
        assert read_frames(tmp_path / "on" / f"{i:04d}.mp4").shape == (5, 32, 32, 3)  # the frames asked for
        assert (tmp_path / "on" / f"{i:04d}-frames.png").is_file()
    with safe_open(str(snapshot), "pt") as f:
        meta = json.loads(f.metadata()["trueflow"])
    group = meta["microgroups"][0]
    assert group["experts"] == ["transformer", "transformer_2"] and group["cfg_scales"] == [4, 3]
    assert meta["params"]["negative_prompt"] == ""  # WanPipeline.encode_prompt's default, `negative_prompt or ""`
    for t in (0, 1):  # one step on each expert
        assert replay_snapshot_step(snapshot, 0, t, script=WAN_REPLAY) == {
            "microgroup": 0, "step": t, "expert": group["experts"][t], "bitwise_equal": True, "max_abs_diff": 0.0}
    # the failing side: the engine's fast numerics are not diffusers'
    off = _generate(wan_a14b_checkpoint, tmp_path / "off", "none", "--cfg-scale-2", "3", images=1)
    assert replay_snapshot_step(off, 0, 1, script=WAN_REPLAY)["bitwise_equal"] is False
    # TI2V-5B image-to-video: the first frame conditions every sample; its replay puts it in as the pipeline does
    image = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(image)
    i2v = _generate(wan_ti2v_checkpoint, tmp_path / "i2v", "wan", "--image", str(image), images=1)
    assert read_frames(tmp_path / "i2v" / "0000.mp4").shape == (5, 64, 64, 3)
    assert "mg0/positive/image_latents" in load_file(str(i2v))
    assert replay_snapshot_step(i2v, 0, 1, script=WAN_REPLAY)["bitwise_equal"] is True


# -- train -------------------------------------------------------------------------------------------------------------
def _train(checkpoint: Path, out: Path, resolution: int, steps: int, cfg_scale: float,
           cfg_scale_2: float | None = None) -> list[dict]:
    cfg = TrainConfig(output_dir=str(out), checkpoint=str(checkpoint), num_frames=5, resolution=resolution,
                      steps=steps, num_sde_steps=steps, cfg_scale=cfg_scale, cfg_scale_2=cfg_scale_2,
                      num_rollouts=2, rollout_batch_size=1,
                      n_samples_per_prompt=2, rollout_microgroup_size=2, micro_batch_size_sample=2, sample_every=0,
                      lr=0.05, debug=True)
    run_training(cfg)
    assert (cfg.rollout_patch_group, cfg.fsdp_attention_backend) == ("wan", "_native_flash")  # the family's pairing
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["log_prob_max_abs_diff"] == 0.0, r
        assert r["lora_update_norm"] > 0 and r["checksums_equal"] and r["policy_ratio_mean"] == 1.0, r
    return rows


def test_train_is_bitwise_across_the_expert_boundary_and_trains_both_experts(wan_a14b_checkpoint, tmp_path):
    from diffusers import WanPipeline
    from peft.utils import get_peft_model_state_dict

    from trueflow.train.checkpoint import LORA_FILE, latest_checkpoint

    # 2 steps: at the A14B's shift 3.0 the schedule's timesteps are 1000 and 9: the first step runs `transformer`,
    # the second `transformer_2`; both steps stochastic, so both experts train.
    _train(wan_a14b_checkpoint, tmp_path / "run", SIZES["a14b"], steps=2, cfg_scale=4.0, cfg_scale_2=3.0)
    assert_matches_recorded_run(tmp_path / "run", "wan_train")  # the run as recorded (tests/golden), bit for bit
    with safe_open(str(tmp_path / "run" / "snapshots" / "rollout-00001.safetensors"), "pt") as f:
        group = json.loads(f.metadata()["trueflow"])["microgroups"][0]
    assert group["experts"] == ["transformer", "transformer_2"] and group["sde_steps"] == [0, 1]
    assert group["cfg_scales"] == [4.0, 3.0]  # each expert at its own scale on both sides
    final = latest_checkpoint(tmp_path / "run")
    files = {"transformer": LORA_FILE, "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}
    pipe = WanPipeline.from_pretrained(wan_a14b_checkpoint)
    for expert, name in files.items():
        saved = load_file(final / name)
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k), f"{expert}: B never moved"
        # WanPipeline loads each expert's file into that expert (WanLoraLoaderMixin)
        pipe.load_lora_weights(final, weight_name=name, adapter_name=expert,
                               **({"load_into_transformer_2": True} if expert == "transformer_2" else {}))
        model = pipe.transformer if expert == "transformer" else pipe.transformer_2
        loaded = get_peft_model_state_dict(model, adapter_name=expert)
        assert sorted(f"transformer.{k}" for k in loaded) == sorted(saved)
        assert all(torch.equal(loaded[k], saved[f"transformer.{k}"]) for k in loaded)


def test_train_the_ti2v_layout_is_bitwise(wan_ti2v_checkpoint, tmp_path):
    _train(wan_ti2v_checkpoint, tmp_path / "run", SIZES["ti2v"], steps=2, cfg_scale=1.0)  # CFG: the A14B's run
    tensors = load_file(str(tmp_path / "run" / "snapshots" / "rollout-00000.safetensors"))
    assert tensors["mg0/timesteps"].shape == (2, 2 * 2 * 2)  # a timestep per token (grid 2 x 2 x 2)


def test_the_recipes_load_aligned():
    """recipes/wan22_*.yaml: the public recipes' settings, every parity condition kept."""
    a14b = config_from_argv(["--config", "recipes/wan22_a14b.yaml", "--family", "wan"])
    assert (a14b.steps, a14b.cfg_scale, a14b.cfg_scale_2, a14b.num_frames, a14b.noise_level) == (10, 4.0, 3.0, 5, 0.7)
    assert (a14b.lora_rank, a14b.lora_alpha, a14b.reward, a14b.reward_frames, a14b.clip_range) == (
        64, 128, "pickscore", 5, 1e-4)
    ti2v = config_from_argv(["--config", "recipes/wan22_ti2v5b.yaml", "--family", "wan"])
    assert (ti2v.steps, ti2v.cfg_scale, ti2v.num_frames, ti2v.num_sde_steps, ti2v.sde_window) == (20, 5.0, 49, 2,
                                                                                                   (1, 20))
    for cfg in (a14b, ti2v):
        cfg.fill_family_defaults()
        assert cfg.parity_warnings() == []
    # A full fine-tune is not bitwise on Wan (1.95e-3 at the first step on the tiny TI2V-5B): FSDP2's bf16 compute
    # copies of the trained masters round what diffusers keeps in fp32. It is named, not passed silently.
    full = config_from_argv(["--config", "recipes/wan22_ti2v5b.yaml", "--family", "wan", "--no-use-lora"])
    full.fill_family_defaults()
    (warning,) = full.parity_warnings()
    assert warning.startswith("--no-use-lora on wan: diffusers keeps rope, time_embedder, scale_shift_table, norm1, "
                              "norm2, norm3 in fp32")


# -- refusals ----------------------------------------------------------------------------------------------------------
def test_bad_input_is_refused_in_one_line(wan_a14b_checkpoint, wan_ti2v_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    index = json.loads((wan_a14b_checkpoint / "model_index.json").read_text())
    for name, change in (("no_boundary", {"boundary_ratio": None}), ("no_expert", {"transformer_2": [None, None]})):
        broken = tmp_path / name
        shutil.copytree(wan_a14b_checkpoint, broken, ignore=shutil.ignore_patterns("*.safetensors"))
        (broken / "model_index.json").write_text(json.dumps({**index, **change}))
        want = "names transformer_2 without a boundary_ratio" if name == "no_boundary" else \
            "has a boundary_ratio but no transformer_2 component"
        assert want in _one_line_error(capsys, "parity", "--checkpoint", str(broken))
        assert want in _one_line_error(capsys, "generate", "--checkpoint", str(broken), "--prompt", "x",
                                       "--output-dir", str(tmp_path / "o"))
    # a frame count not of the form 4k + 1
    line = _one_line_error(capsys, "generate", "--checkpoint", str(wan_a14b_checkpoint), "--prompt", "x",
                           "--num-frames", "8", "--resolution", "32", "--output-dir", str(tmp_path / "o"))
    assert "num_frames must be 1, 5, 9, ..." in line and "4k + 1" in line
    assert "4k + 1" in _one_line_error(capsys, "train", "--checkpoint", str(wan_a14b_checkpoint), "--num-frames",
                                       "6", "--resolution", "32", "--output-dir", str(tmp_path / "r"))
    # image-to-video without its image, and an image where the layout takes none (the A14B)
    line = _one_line_error(capsys, "generate", "--checkpoint", str(wan_ti2v_checkpoint), "--prompt", "x",
                           "--num-frames", "5", "--image", str(tmp_path / "missing.png"), "--output-dir",
                           str(tmp_path / "o"))
    assert "missing.png: no such file; image-to-video needs its first frame" in line
    assert "takes no first-frame image here" in _one_line_error(
        capsys, "generate", "--checkpoint", str(wan_a14b_checkpoint), "--prompt", "x", "--num-frames", "5",
        "--resolution", "32", "--image", str(tmp_path / "missing.png"), "--output-dir", str(tmp_path / "o"))
    # a size that is not a whole number of tokens (16 px on the A14B, 32 px on the TI2V-5B)
    assert "multiple of 32" in _one_line_error(capsys, "generate", "--checkpoint", str(wan_ti2v_checkpoint),
                                               "--prompt", "x", "--num-frames", "5", "--resolution", "48",
                                               "--output-dir", str(tmp_path / "o"))
