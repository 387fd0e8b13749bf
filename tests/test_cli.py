"""`trueflow` on the command line: the verbs, `parity --json` (bitwise with the group, not without), `--ablate`,
`--save`, and a bad `--disable-patch`."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import TRUEFLOW_EXE, assert_bitwise, pipeline_timestep
from trueflow.cli import VERBS, main
from trueflow.models.qwen_image.patches import GROUP


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def parity_args(checkpoint, *extra: str) -> list[str]:
    return ["parity", "--checkpoint", str(checkpoint), "--batch", "4", "--lora-rank", "8", *extra]


def test_help_lists_the_verbs():
    assert TRUEFLOW_EXE.is_file(), f"no console script at {TRUEFLOW_EXE}"
    proc = subprocess.run([str(TRUEFLOW_EXE), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {"init-checkpoint", "parity", "patches"} <= set(VERBS)
    for verb in VERBS:  # every registered verb, with its one-line help
        assert verb in proc.stdout, verb
        assert VERBS[verb][0] in " ".join(proc.stdout.split()), verb


@pytest.mark.parametrize("group", ["qwen_image", "none"])
def test_parity_json(tiny_checkpoint, capsys, group):
    rc, out, err = run_main(capsys, *parity_args(tiny_checkpoint, "--patch-group", group, "--json"))
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, "expected one JSON object on one line"
    result = json.loads(lines[0])
    assert isinstance(result, dict) and result["patch_group"] == group
    if group == "qwen_image":
        assert result["model_output_max_abs_diff"] == 0.0 and result["bitwise_equal"] is True
        assert result["first_differing_module"] is None
        assert result["patches_applied"] == list(GROUP.patch_names)
        assert result["layers"] and all(row["max_abs_diff"] == 0.0 for row in result["layers"])
    else:  # the failing side
        assert result["model_output_max_abs_diff"] > 0.0 and result["bitwise_equal"] is False
        assert result["patches_applied"] == []
        assert result["first_differing_module"]


def test_parity_ablate_names_every_patch(tiny_checkpoint, capsys):
    rc, out, err = run_main(capsys, *parity_args(tiny_checkpoint, "--patch-group", "qwen_image", "--ablate"))
    assert rc == 0, err
    assert "bitwise equal: yes" in out
    rows = {}
    for line in out.splitlines():
        for p in GROUP.patch_names:
            if line.strip().startswith(f"without {p} "):
                rows[p] = line
    assert set(rows) == set(GROUP.patch_names), sorted(set(GROUP.patch_names) - set(rows))
    assert "--patch-group none" in out and "--patch-group qwen_image (all patches)" in out
    # every rounding patch, switched off alone, breaks parity even on the tiny model at batch 4
    for p in ("rms_norm", "layer_norm_scale_shift", "scale_residual_layer_norm_scale_shift", "mul_add",
              "qk_norm_rope", "timestep_dtype", "lora_unmerged", "contiguous_split"):
        assert rows[p].split()[2] != "0.0", rows[p]


def test_parity_save(tiny_checkpoint, tmp_path, capsys):
    out_dir = tmp_path / "probe"
    rc, out, err = run_main(capsys, *parity_args(tiny_checkpoint, "--patch-group", "qwen_image", "--json",
                                                 "--save", str(out_dir)))
    assert rc == 0, err
    assert {p.name for p in out_dir.iterdir()} >= {"manifest.json", "inputs.safetensors", "lora.safetensors"}
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["result"]["bitwise_equal"] is True and manifest["result"]["model_output_max_abs_diff"] == 0.0
    assert manifest["lora"]["rank"] == 8 and manifest["lora"]["file"] == "lora.safetensors"
    assert manifest["checkpoint"] == str(tiny_checkpoint.resolve())
    inputs = load_file(out_dir / "inputs.safetensors")
    assert inputs["hidden_states"].shape[0] == 4 and inputs["engine_output"].dtype == torch.bfloat16
    assert_bitwise(inputs["timestep_train"], pipeline_timestep(inputs["timestep"], torch.bfloat16),
                   "timestep as the train side gets it")
    lora = load_file(out_dir / "lora.safetensors")
    assert lora and all(".lora_A." in k or ".lora_B." in k for k in lora)
    assert any(v.abs().max() > 0 for k, v in lora.items() if ".lora_B." in k)


def test_disable_unknown_patch(tiny_checkpoint, capsys):
    rc, out, err = run_main(capsys, "parity", "--checkpoint", str(tiny_checkpoint), "--patch-group", "qwen_image",
                            "--disable-patch", "bogus")
    assert rc == 2
    assert out == ""
    assert "bogus" in err and "Traceback" not in err
    for p in GROUP.patch_names:
        assert p in err, p
