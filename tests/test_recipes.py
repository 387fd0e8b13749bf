"""Every recipe is self-contained (its family, device and every setting it needs, in the file): `--print-config`
loads it as written, it breaks no parity condition, and a shrunk run of it (sizes and steps overridden on the command
line, everything else as the recipe says) trains on the tiny checkpoint of its family with 0.0 at every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trueflow.cli import main
from trueflow.train.config import TrainConfig, config_from_argv
from trueflow.train.metrics import read_metrics

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
# What shrinks a run to seconds on a CPU, and nothing else (the reward: PickScore needs a model folder).
SHRINK = ["--device", "cpu", "--num-rollouts", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
          "--rollout-microgroup-size", "2", "--micro-batch-size-sample", "2", "--sample-every", "0", "--no-debug",
          "--reward", "redness"]
FAMILY_SHRINK = {"qwen_image": ["--steps", "2", "--num-sde-steps", "1"],
                 "ltx2": ["--steps", "3", "--num-sde-steps", "1", "--sde-window", "0,2", "--resolution", "32",
                          "--num-frames", "9", "--lora-rank", "4", "--lora-alpha", "8"],
                 "sd3": ["--steps", "2", "--num-sde-steps", "1", "--sde-window", "0,2", "--resolution", "32",
                         "--max-sequence-length", "8", "--lora-rank", "4", "--lora-alpha", "8"],
                 "wan": ["--steps", "2", "--num-sde-steps", "1", "--sde-window", "0,2", "--resolution", "32",
                         "--num-frames", "5", "--max-sequence-length", "8", "--lora-rank", "4", "--lora-alpha", "8"],
                 "flux": ["--steps", "2", "--num-sde-steps", "1", "--sde-window", "0,2", "--resolution", "32",
                          "--max-sequence-length", "8", "--lora-rank", "4", "--lora-alpha", "8"]}


def test_there_are_recipes():
    assert {r.name for r in RECIPES} >= {"bitwise-aligned.yaml", "diffusion-nft.yaml", "ltx23.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.stem)
def test_a_recipe_names_its_family_and_device_and_prints_as_written(recipe, capsys, tmp_path):
    raw = yaml.safe_load(recipe.read_text())
    assert raw["model"]["family"] and raw["parallel"]["device"], "a recipe says which family and device it is for"
    assert main(["train", "--config", str(recipe), "--print-config"]) == 0  # nothing added on the command line
    printed = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(printed)
    cfg = config_from_argv(["--config", str(recipe)])
    assert config_from_argv(["--config", str(tmp_path / "printed.yaml")]) == cfg
    nested = cfg.to_nested()
    for top, value in raw.items():  # every setting as the file says
        given = value if isinstance(value, dict) else {None: value}
        for key, v in given.items():
            assert (nested[top][key] if key else nested[top]) == v, (top, key)
    assert cfg.parity_warnings() == [], "a recipe keeps every condition of bitwise parity"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.stem)
def test_a_shrunk_run_of_a_recipe_trains_bitwise(recipe, tmp_path, request):
    family = yaml.safe_load(recipe.read_text())["model"]["family"]
    # the tiny checkpoint of the recipe's family (of its layout: Wan2.2's TI2V-5B recipe takes the dense one)
    checkpoint = request.getfixturevalue({"qwen_image": "tiny_checkpoint", "ltx2": "ltx2_checkpoint",
                                          "sd3": "sd3_checkpoint", "flux": "flux_checkpoint",
                                          "wan": "wan_ti2v_checkpoint" if "ti2v" in recipe.stem else
                                          "wan_a14b_checkpoint"}[family])
    out = tmp_path / "run"
    argv = ["--config", str(recipe), "--checkpoint", str(checkpoint), "--output-dir", str(out), *SHRINK,
            *FAMILY_SHRINK[family]]
    assert main(["train", *argv]) == 0
    cfg: TrainConfig = config_from_argv(argv)
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == cfg.num_steps_per_rollout
    for r in rows:
        assert r["model_output_max_abs_diff"] == 0.0 and r["checksums_equal"], r
