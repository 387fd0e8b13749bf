"""SD3.5 through the generic code, as a user runs it: `init-checkpoint --family sd3` (the real pipeline layout, seeded),
`parity` (bitwise under the `sd3` group with and without LoRA and with batched CFG, not without the group; the
ablation naming each patch), `generate` (images, and a snapshot whose step diffusers alone replays bit for bit),
`train` (0.0 at every step with CFG and LoRA, the recorded run), the flow_grpo recipes, and bad input in one line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from PIL import Image
from safetensors import safe_open

from conftest import assert_matches_recorded_run, replay_snapshot_step
from trueflow.cli import main
from trueflow.models.sd3.patches import GROUP
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.train.metrics import read_metrics

TRAIN = ["--num-rollouts", "2", "--rollout.batch-size", "1", "--n-samples-per-prompt", "2",
         "--rollout.microgroup-size", "2", "--micro-batch-size-sample", "2", "--steps", "2", "--num-sde-steps", "2",
         "--cfg-scale", "4.5", "--negative-prompt", "", "--max-sequence-length", "16", "--sample-every", "0",
         "--lr", "0.05", "--resolution", "64", "--debug"]
RECIPES = ("sd3_pickscore", "sd3_ocr", "sd3_geneval", "sd3_pickscore_fast", "sd3_pickscore_fast_nocfg",
           "sd3_geneval_fast_nocfg")


def _stdout(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


def test_the_checkpoint_is_the_pipelines_layout_and_seeded(sd3_checkpoint, tmp_path):
    index = json.loads((sd3_checkpoint / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert {k: v[1] for k, v in index.items() if not k.startswith("_") and v[0] is not None} == {
        "scheduler": "FlowMatchEulerDiscreteScheduler", "vae": "AutoencoderKL", "transformer": "SD3Transformer2DModel",
        "text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
        "text_encoder_3": "T5EncoderModel", "tokenizer": "CLIPTokenizer", "tokenizer_2": "CLIPTokenizer",
        "tokenizer_3": "T5Tokenizer"}
    scheduler = json.loads((sd3_checkpoint / "scheduler" / "scheduler_config.json").read_text())
    assert (scheduler["shift"], scheduler["use_dynamic_shifting"]) == (3.0, False)
    other = tmp_path / "seed1"
    assert main(["init-checkpoint", "--family", "sd3", "--size", "tiny", "--seed", "1", "--out", str(other)]) == 0
    shard = "transformer/diffusion_pytorch_model.safetensors"
    assert (other / shard).read_bytes() != (sd3_checkpoint / shard).read_bytes()
    for folder in ("text_encoder_3", "tokenizer_2"):  # the whole pipeline is seeded alike
        assert sorted(p.name for p in (other / folder).iterdir()) == sorted(
            p.name for p in (sd3_checkpoint / folder).iterdir())


def test_parity_is_bitwise_under_the_sd3_group_and_not_without(sd3_checkpoint):
    """With and without LoRA, with batched CFG: 0.0 under `sd3`, not under `none`; the ablation lists every patch
    (the LoRA run, from the CLI, as a user runs it)."""
    table = _stdout(["parity", "--checkpoint", str(sd3_checkpoint), "--patch-group", "sd3", "--lora-rank", "8",
                     "--ablate"])
    rows = {line.split("  ")[1].strip(): line for line in table.splitlines() if line.startswith("  ") and
            "abs diff" not in line and "----" not in line}
    assert rows["--patch-group sd3 (all patches)"].split()[4:6] == ["0.0", "0.0"]
    assert float(rows["--patch-group none"].split()[2]) > 0
    assert [name.removeprefix("without ") for name in rows if name.startswith("without ")] == list(GROUP.patch_names)
    probe = ParityProbe(ProbeSpec(checkpoint=str(sd3_checkpoint), batch=2, cfg_scale=4.5))
    on, off = probe.run("sd3")[0], probe.run("none")[0]
    assert on.bitwise_equal and on.model_output_max_abs_diff == 0.0 and on.engine_attention_backend == \
        "sdpa_heads_major" and on.train_attention_backend == "native"
    assert not off.bitwise_equal and off.model_output_max_abs_diff > 0


def test_generate_writes_images_and_a_snapshot_diffusers_replays(sd3_checkpoint, tmp_path):
    out = tmp_path / "on"
    _stdout(["generate", "--checkpoint", str(sd3_checkpoint), "--prompt", "a red apple", "--n-samples-per-prompt", "2",
             "--resolution", "64", "--steps", "2", "--sampler", "sde", "--cfg-scale", "4.5", "--patch-group", "sd3",
             "--snapshot", str(out / "s.safetensors"), "--output-dir", str(out)])
    for i in range(2):
        assert Image.open(out / f"{i:04d}.png").size == (64, 64)
    for t in (0, 1):
        assert replay_snapshot_step(out / "s.safetensors", 0, t, script="replay_sd3_step.py") == {
            "microgroup": 0, "step": t, "bitwise_equal": True, "max_abs_diff": 0.0}
    # the failing side: the engine's fast numerics are not diffusers' (short text: this side needs no CLI)
    from trueflow.engine.engine import Engine
    from trueflow.engine.request import RolloutRequest
    from trueflow.engine.sampling_params import SamplingParams
    from trueflow.engine.snapshot import save_snapshot

    params = SamplingParams(steps=1, cfg_scale=4.5, max_sequence_length=8)
    rollout = Engine(sd3_checkpoint).rollout(RolloutRequest(["a red apple"], 2, params, 0, decode=False,
                                                            record_snapshot=True))
    fast = save_snapshot(rollout, tmp_path / "off.safetensors")
    assert replay_snapshot_step(fast, 0, 0, script="replay_sd3_step.py")["bitwise_equal"] is False


def test_train_is_bitwise_at_every_step(sd3_checkpoint, tmp_path):
    """2 rollouts with batched CFG and LoRA: 0.0 at every step, the LoRA moving, the run recorded in
    tests/golden/sd3_train reproduced; the snapshot records the batched guidance and both branches' pooled stream."""
    run = tmp_path / "run"
    assert main(["train", "--checkpoint", str(sd3_checkpoint), "--output-dir", str(run), *TRAIN]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["log_prob_max_abs_diff"] == 0.0, r
        assert r["lora_update_norm"] > 0 and r["checksums_equal"] and r["policy_ratio_mean"] == 1.0
    assert_matches_recorded_run(run, "sd3_train")
    with safe_open(str(run / "snapshots" / "rollout-00000.safetensors"), "pt") as f:
        meta, keys = json.loads(f.metadata()["trueflow"]), set(f.keys())
        pooled = f.get_tensor("mg0/negative/pooled_projections")
    assert meta["guidance"] == {"branches": "batched", "formula": "plain_cfg", "distilled_input": None}
    assert meta["params"]["max_sequence_length"] == 16
    assert {"mg0/positive/pooled_projections", "mg0/negative/encoder_hidden_states"} <= keys
    assert pooled.shape == (2, 32) and meta["microgroups"][0]["cfg_scales"] == [4.5] * 2
    # the first rollout ran before any update (PEFT's B = 0): diffusers' base transformer replays its SDE step
    assert replay_snapshot_step(run / "snapshots" / "rollout-00000.safetensors", 0,
                                meta["microgroups"][0]["sde_steps"][0],
                                script="replay_sd3_step.py")["bitwise_equal"] is True


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_flow_grpo_recipes_load_aligned(recipe):
    from trueflow.train.config import config_from_argv

    cfg = config_from_argv(["--config", f"recipes/{recipe}.yaml"])  # it names its family
    assert (cfg.steps, cfg.resolution, cfg.max_sequence_length, cfg.lora_rank, cfg.lora_alpha) == (10, 512, 128, 32, 64)
    assert cfg.global_std and cfg.rollout_microgroup_size == cfg.micro_batch_size_sample
    assert cfg.n_samples_per_prompt % cfg.rollout_microgroup_size == 0
    nocfg = recipe.endswith("_nocfg")
    assert (cfg.sampler, cfg.cfg_scale) == (("cps", 1.0) if nocfg else ("sde", 4.5))
    assert (cfg.noise_level, cfg.clip_range) == ((0.8, 1e-5) if "fast" in recipe else (0.7, 1e-4))
    assert cfg.kl_beta == {"sd3_pickscore": 0.01, "sd3_ocr": 0.04, "sd3_geneval": 0.04}.get(recipe, 0.0)
    cfg.fill_family_defaults()
    assert cfg.rollout_patch_group == "sd3" and cfg.fsdp_attention_backend == "native"
    assert cfg.parity_warnings() == []


def _one_line_error(capsys, *argv: str) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line(sd3_checkpoint, capsys, tmp_path):
    ckpt = str(sd3_checkpoint)
    gen = ["generate", "--checkpoint", ckpt, "--prompt", "x", "--steps", "1", "--output-dir", str(tmp_path / "g")]
    for extra, match in ((["--resolution", "72"], "multiple of 16 pixels for sd3 (VAE factor 8 x patch 2"),
                         (["--num-frames", "9"], "SD3 makes images: num_frames must be 1"),
                         (["--distilled-guidance-scale", "3"], "sd3 has no distilled guidance input")):
        assert match in _one_line_error(capsys, *gen, *extra)
    assert "never reaches it; use native" in _one_line_error(capsys, "parity", "--checkpoint", ckpt, "--patch-group",
                                                             "sd3:_native_flash")
    assert "sd3 takes at most 512 text tokens" in _one_line_error(capsys, "train", "--checkpoint", ckpt, "--output-dir",
                                                         str(tmp_path / "r"), "--max-sequence-length", "600")
