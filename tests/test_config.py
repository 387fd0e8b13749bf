"""`trueflow train` settings: sections with the same names in YAML and flags, the flat flags and files of before
still read (as aliases, a flat file with a warning), and `--print-config` output that loads back to the same
settings. No model is loaded here."""

from __future__ import annotations

import warnings

import pytest
import yaml

from trueflow.cli import main
from trueflow.train.config import SECTIONS, FlatConfigWarning, TrainConfig, config_from_argv

# Every setting `trueflow train` had before sections, by its flag, with a value other than its default and that
# value as the config holds it (written out here, not read from the code under test).
FLAT_FLAGS = {
    "--output-dir": ("runs/x", "runs/x"), "--checkpoint": ("/models/q", "/models/q"),
    "--prompts": ("p.txt", "p.txt"), "--num-rollouts": ("7", 7), "--num-steps-per-rollout": ("2", 2),
    "--rollout-batch-size": ("3", 3), "--n-samples-per-prompt": ("8", 8), "--rollout-microgroup-size": ("2", 2),
    "--steps": ("9", 9), "--sampler": ("cps", "cps"), "--noise-level": ("1.2", 1.2), "--num-sde-steps": ("3", 3),
    "--sde-window": ("1,5", (1, 5)), "--cfg-scale": ("2.5", 2.5), "--negative-prompt": ("blurry", "blurry"),
    "--resolution": ("128", 128), "--rollout-patch-group": ("qwen_image", "qwen_image"),
    "--disable-patch": ("rms_norm", ["rms_norm"]),
    "--lora-merge-mode": ("merged", "merged"), "--micro-batch-size-sample": ("2", 2),
    "--micro-batch-size-tstep": ("2", 2), "--train-dp-split-mode": ("stride", "stride"),
    "--fsdp-attention-backend": ("native", "native"), "--pad-text-to": ("64", 64), "--lora-rank": ("16", 16),
    "--lora-alpha": ("32", 32.0), "--lora-target-modules": ("to_q,to_k", ["to_q", "to_k"]), "--lr": ("0.01", 0.01),
    "--weight-decay": ("0.1", 0.1), "--max-grad-norm": ("0.5", 0.5), "--clip-range": ("0.2", 0.2),
    "--adv-clip-max": ("3", 3.0), "--kl-beta": ("0.04", 0.04), "--reward": ("pickscore", "pickscore"),
    "--reward-model": ("/models/ps", "/models/ps"), "--reward-placement": ("engine", "engine"),
    "--reward-on-error": ("skip", "skip"), "--seed": ("5", 5), "--dtype": ("fp32", "fp32"),
    "--device": ("cuda", "cuda"),
    "--save-every": ("4", 4), "--sample-every": ("2", 2),
}
FLAT_SWITCHES = ["--gradient-checkpointing", "--global-std", "--engine-process", "--debug",
                 "--debug-skip-optimizer-step", "--resume", "--tensorboard"]
# The recipe as it was written before sections.
FLAT_RECIPE = """
family: qwen_image
num_steps_per_rollout: 1
rollout_microgroup_size: 4
micro_batch_size_sample: 4
micro_batch_size_tstep: 1
train_dp_split_mode: contiguous
fsdp_attention_backend: _native_flash
rollout_patch_group: qwen_image
lora_merge_mode: unmerged
num_rollouts: 3
rollout_batch_size: 2
n_samples_per_prompt: 4
use_lora: true
lora_rank: 8
debug: true
"""


def flat_argv() -> list[str]:
    argv = [a for flag, (value, _) in FLAT_FLAGS.items() for a in (flag, value)]
    return argv + FLAT_SWITCHES


def test_every_flat_flag_still_sets_its_setting():
    cfg = config_from_argv(flat_argv())
    for flag, (_, expected) in FLAT_FLAGS.items():
        name = {"--rollout-patch-group": "rollout_patch_group"}.get(flag, flag[2:].replace("-", "_"))
        assert getattr(cfg, name) == expected, flag
    for flag in FLAT_SWITCHES:
        assert getattr(cfg, flag[2:].replace("-", "_")) is True, flag
    for flag in ("--patch-group", "--rollout-patch-group"):  # the default is qwen_image
        assert config_from_argv([flag, "none"]).rollout_patch_group == "none"
    assert config_from_argv(["--no-use-lora", "--use-lora"]).use_lora is True
    assert config_from_argv(["--disable-patch", "a", "--disable-patch", "b"]).disable_patch == ["a", "b"]


def test_sectioned_flags_and_yaml_use_the_same_names(tmp_path):
    """Each setting's sectioned flag `--section.key` sets the same value as `section: {key: ...}` in a file, and
    as its flat flag."""
    cfg = config_from_argv(flat_argv())
    nested = cfg.to_nested()
    assert list(nested)[-len(SECTIONS):] == list(SECTIONS)
    argv = []
    for top, value in nested.items():
        items = value.items() if top in SECTIONS else [(None, value)]
        for key, v in items:
            flag = "--" + (f"{top}.{key}" if key else top).replace("_", "-")
            if isinstance(v, bool):
                argv.append(flag if v else "--no-" + flag[2:])
            elif isinstance(v, list):
                argv += [flag, ",".join(map(str, v))]
            else:
                argv += [flag, "null" if v is None else str(v)]
    assert config_from_argv(argv) == cfg
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(nested))
    assert config_from_argv(["--config", str(tmp_path / "c.yaml")]) == cfg


def test_print_config_loads_back_to_the_same_settings(tmp_path, capsys):
    argv = ["--steps", "9", "--lr", "0.01", "--sde-window", "1,5", "--disable-patch", "rms_norm", "--pad-text-to", "64",
            "--reward", "pickscore:1,redness:0.5", "--negative-prompt", "a: 'quoted' # not a comment", "--resume"]
    assert main(["train", "--print-config", *argv]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("output_dir: runs/train\n") and "\nrollout:\n  prompts: null\n" in printed
    (tmp_path / "c.yaml").write_text(printed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sectioned: no flat-file warning
        assert config_from_argv(["--config", str(tmp_path / "c.yaml")]) == config_from_argv(argv)
    assert main(["train", "--print-config", "--config", str(tmp_path / "c.yaml")]) == 0
    assert capsys.readouterr().out == printed
    assert not (tmp_path / "runs").exists()


def test_flags_override_the_file(tmp_path):
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 0.5\n  weight_decay: 0.1\nrollout:\n  steps: 7\n")
    cfg = config_from_argv(["--config", str(tmp_path / "c.yaml"), "--optim.lr", "0.25", "--steps", "5"])
    assert (cfg.lr, cfg.weight_decay, cfg.steps) == (0.25, 0.1, 5)


def test_a_flat_file_still_loads_with_a_warning(tmp_path):
    (tmp_path / "flat.yaml").write_text(FLAT_RECIPE)
    with pytest.warns(FlatConfigWarning,
                      match="flat settings file.*rollout_microgroup_size -> rollout.microgroup_size"):
        flat = config_from_argv(["--config", str(tmp_path / "flat.yaml")])
    sectioned = config_from_argv(["--config", "recipes/bitwise-aligned.yaml"])
    assert flat == sectioned
    assert (flat.num_rollouts, flat.rollout_microgroup_size, flat.lora_rank, flat.debug) == (3, 4, 8, True)
    # `checkpoint:` and `reward:` are sections, or in a flat file the model folder and the reward spec
    (tmp_path / "flat2.yaml").write_text("checkpoint: /models/q\nreward: pickscore\nsave_every: 2\n")
    with pytest.warns(FlatConfigWarning):
        cfg = config_from_argv(["--config", str(tmp_path / "flat2.yaml")])
    assert (cfg.checkpoint, cfg.reward, cfg.save_every) == ("/models/q", "pickscore", 2)


def test_python_keeps_flat_fields():
    cfg = TrainConfig(steps=3, lr=0.5, rollout_patch_group="none")
    assert (cfg.steps, cfg.lr, cfg.rollout_patch_group) == (3, 0.5, "none")
    assert TrainConfig.from_nested(cfg.to_nested()) == cfg
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr="fast")
    with pytest.raises(ValueError, match="steps"):
        cfg.steps = 0  # assignments are checked too


def test_height_and_width_override_the_square_side():
    """`--height`/`--width` (as `generate` takes them) win over `--resolution`; each side is checked against the
    family's granule, and the grid they make against the frame count."""
    assert TrainConfig(resolution=64).frame_size() == (64, 64)
    cfg = config_from_argv(["--family", "ltx2", "--resolution", "512", "--width", "768", "--num-frames", "33"])
    assert cfg.frame_size() == (512, 768) and cfg.combination_errors() == []
    assert TrainConfig(family="ltx2", resolution=64, height=96).frame_size() == (96, 64)
    with pytest.raises(ValueError, match=r"--width 80 must be a multiple of 32 \(VAE spatial factor 32"):
        TrainConfig(family="ltx2", width=80)
    with pytest.raises(ValueError, match="--num-frames 8: "):
        TrainConfig(family="ltx2", width=96, num_frames=8)


def test_processes_that_compute_at_once_are_warned_past_the_cores(monkeypatch):
    """Threads past the cores: each rank's `--tp` engine processes, plus the trainer when it trains during a
    rollout (`--async-rollouts`, however far ahead), times the intra-op threads each (counts worked by hand)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    many = TrainConfig(device="cpu", engine_process=True, async_rollouts=1, threads=2)
    assert many.oversubscription(cores=4, default_threads=8) is None  # 2 processes x 2 threads = 4 cores
    line = many.oversubscription(cores=3, default_threads=8)
    assert line is not None and "2 CPU processes compute" in line and "--threads 1" in line
    sync = TrainConfig(device="cpu", engine_process=True, threads=2)  # the trainer waits while its engine works
    assert sync.oversubscription(cores=2, default_threads=8) is None
    assert "1 CPU process computes" in sync.oversubscription(cores=1, default_threads=8)
    tp = TrainConfig(device="cpu", engine_process=True, tp=2)  # torch's default count in each engine rank
    assert "2 CPU processes" in tp.oversubscription(cores=8, default_threads=8) and "--threads 4" in \
        tp.oversubscription(cores=8, default_threads=8)
    assert tp.oversubscription(cores=8, default_threads=4) is None
    both = TrainConfig(device="cpu", engine_process=True, tp=2, async_rollouts=2)  # 2 engine ranks + the trainer
    assert both.oversubscription(cores=6, default_threads=2) is None
    line = both.oversubscription(cores=5, default_threads=2)
    assert "3 CPU processes" in line and "--threads 1" in line
    assert "even --threads 1" in both.oversubscription(cores=2, default_threads=1)
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: every rank has its engine process and trainer
    assert "4 CPU processes" in many.oversubscription(cores=6, default_threads=8)
    assert many.oversubscription(cores=8, default_threads=8) is None
    assert TrainConfig(device="cpu", threads=4).oversubscription(cores=2, default_threads=4) is None  # in process
    assert TrainConfig(device="cuda", engine_process=True, async_rollouts=1, threads=9).oversubscription(
        cores=2, default_threads=9) is None


def test_a_run_that_oversubscribes_the_cores_is_warned_when_it_starts(monkeypatch, tmp_path):
    """`validate` (what `trueflow train` runs before loading) says it, with the process's own core count."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    cfg = TrainConfig(device="cpu", engine_process=True, async_rollouts=1, threads=2, output_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning, match="2 CPU processes compute at once with 2 intra-op threads each on 2 cores"):
        cfg.validate()
