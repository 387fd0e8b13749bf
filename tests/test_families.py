"""Model families are values the registry finds by scanning `trueflow/models/*/`; the Qwen-Image spec agrees with
the diffusers classes and files it names; and a fake family written only in tests/families runs
`init-checkpoint`, `patches` and `parity` through the generic code, bitwise under its patch group."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import trueflow.models as registry
from trueflow.cli import main
from trueflow.engine.sampling_params import SamplingParams, check_family_limits
from trueflow.models import default_family, families, family_for_checkpoint, family_for_config, get_family

FAKE_FAMILIES = Path(__file__).parent / "families"


def test_registry_finds_the_shipped_families_by_scanning():
    found = families()
    assert "qwen_image" in found and default_family() is found["qwen_image"]
    shipped = {p.parent.name for p in (Path(registry.__file__).parent).glob("*/family.py")}
    assert set(found) == shipped
    with pytest.raises(ValueError, match=f"unknown model family 'hunyuan_dit'; valid families: {', '.join(found)}$"):
        get_family("hunyuan_dit")


def test_family_comes_from_model_index(tiny_checkpoint, tmp_path):
    assert family_for_checkpoint(tiny_checkpoint).name == "qwen_image"
    index = json.loads((Path(tiny_checkpoint) / "model_index.json").read_text())  # written by diffusers
    assert index["_class_name"] == get_family("qwen_image").pipeline_class
    with pytest.raises(ValueError, match="drop --family or pass --family qwen_image"):
        family_for_checkpoint(tiny_checkpoint, "toy")
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanDiTPipeline"}))
    with pytest.raises(ValueError, match="no model family for the pipeline class 'HunyuanDiTPipeline'"):
        family_for_checkpoint(other)
    config = json.loads((Path(tiny_checkpoint) / "transformer" / "config.json").read_text())
    assert family_for_config(config).train.transformer_class == config["_class_name"]


def test_qwen_image_spec_matches_diffusers(tiny_checkpoint):
    from peft.tuners.tuners_utils import check_target_module_exists

    fam = get_family("qwen_image")
    train = fam.train.model_class().from_pretrained(tiny_checkpoint, subfolder="transformer")
    names = [n for n, _ in train.named_modules()]
    for target in fam.train.lora_targets:  # each target hits a module, PEFT's own matching
        assert any(check_target_module_exists(type("C", (), {"target_modules": [target]})(), n) for n in names), target
    for unit in fam.train.shard_units + fam.blocks:
        assert isinstance(getattr(train, unit), torch.nn.ModuleList) and len(getattr(train, unit)) > 0


def test_an_engine_checks_its_own_familys_limits():
    """A `SamplingParams` is checked against the default family when made; an engine of a family with a coarser
    image granule or a shorter text window refuses what the default family takes."""
    qwen = get_family("qwen_image")
    coarse = replace(qwen, pipeline=replace(qwen.pipeline, pixels_per_token=32, size_reason="VAE 32",
                                            max_text_tokens=128))
    params = SamplingParams(height=48, width=64, max_sequence_length=256)  # fine for the default family
    check_family_limits(params, qwen)
    with pytest.raises(ValueError, match=r"height must be a positive multiple of 32 pixels \(VAE 32\), got 48"):
        check_family_limits(params, coarse)
    with pytest.raises(ValueError, match=r"max_sequence_length must be in 1..128, got 256"):
        check_family_limits(replace(params, height=64), coarse)


# -- a family that lives only in the tests ---------------------------------------------------------------------
@pytest.fixture
def toy_family(monkeypatch):
    """tests/families on the registry's search path: the `toy_dit` folder is then a family like a shipped one."""
    monkeypatch.setattr(registry, "__path__", [*registry.__path__, str(FAKE_FAMILIES)])
    families.cache_clear()
    yield get_family("toy_dit")
    families.cache_clear()


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_fake_family_runs_parity_through_the_generic_code(toy_family, tmp_path, capsys):
    ckpt = tmp_path / "toy"
    rc, out, _ = _run(capsys, "init-checkpoint", "--family", "toy_dit", "--out", str(ckpt))
    assert rc == 0 and "toy_dit checkpoint" in out
    assert family_for_checkpoint(ckpt) is toy_family

    rc, out, _ = _run(capsys, "patches", "--patch-group", "toy")
    assert rc == 0
    assert [line.split()[0] for line in out.splitlines()] == ["layer_norm_add", "timestep_dtype", "lora_unmerged"]

    def parity(group: str, *extra: str) -> dict:
        rc, out, err = _run(capsys, "parity", "--checkpoint", str(ckpt), "--patch-group", group, "--batch", "2",
                            "--lora-rank", "4", "--json", *extra)
        assert rc == 0, err
        return json.loads(out)

    exact = parity("toy", "--ablate")
    assert exact["model_output_max_abs_diff"] == 0.0 and exact["bitwise_equal"]
    assert exact["patches_applied"] == ["layer_norm_add", "timestep_dtype", "lora_unmerged"]
    assert exact["train_attention_backend"] == "native"
    # the per-layer report compares the toy's own modules by their diffusers names
    assert {r["module"] for r in exact["layers"]} >= {"proj_in", "transformer_blocks.1.ff", "proj_out"}
    assert all(r["max_abs_diff"] == 0.0 for r in exact["layers"])
    ablation = {(r["patch_group"], *r["disabled_patches"]): r["model_output_max_abs_diff"] for r in exact["ablation"]}
    assert ablation[("toy",)] == 0.0 and ablation[("none",)] > 0
    assert ablation[("toy", "layer_norm_add")] > 0 and ablation[("toy", "lora_unmerged")] > 0

    fast = parity("none")
    assert fast["model_output_max_abs_diff"] > 0 and not fast["bitwise_equal"]
    assert fast["first_differing_module"] is not None


def test_fake_family_trains_through_the_generic_code(toy_family, tmp_path, capsys, monkeypatch):
    """Two rollouts of `trueflow train --family toy_dit` (the default checkpoint, made of that family): the trainer
    loads the toy's diffusers class, its LoRA targets and its patch group from the family, the train forward equals
    the engine's bitwise at every step, the LoRA moves, and the checkpoint is written by the toy's pipeline class."""
    from safetensors.torch import load_file

    from trueflow.train.checkpoint import LORA_FILE, latest_checkpoint

    monkeypatch.chdir(tmp_path)  # the default checkpoint is made under ./runs
    out = tmp_path / "run"
    rc, _, err = _run(capsys, "train", "--family", "toy_dit", "--output-dir", str(out), "--num-rollouts", "2",
                      "--rollout.batch-size", "1", "--n-samples-per-prompt", "2", "--rollout.microgroup-size", "2",
                      "--micro-batch-size-sample", "2", "--steps", "2", "--cfg-scale", "1", "--sample-every", "0",
                      "--lr", "0.05")
    assert rc == 0, err
    assert family_for_checkpoint(tmp_path / "runs" / "tiny-checkpoint") is toy_family
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert [r["model_output_max_abs_diff"] for r in rows] == [0.0, 0.0]
    assert all(r["lora_update_norm"] > 0 for r in rows)
    config = json.loads((latest_checkpoint(out) / "trainer_state.json").read_text())["config"]
    assert (config["rollout_patch_group"], config["fsdp_attention_backend"]) == ("toy", "native")
    assert config["lora_target_modules"] == list(toy_family.train.lora_targets)
    saved = load_file(latest_checkpoint(out) / LORA_FILE)
    assert saved and all(k.startswith("transformer.transformer_blocks.") for k in saved)
