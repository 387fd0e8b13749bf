"""`trueflow generate` and debug snapshots: PNGs + settings, bitwise-reproducible snapshot files, every key
documented, and a step replayed with diffusers alone (docs/snapshot.md's own script) equal to the record."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import assert_bitwise, replay_snapshot_step
from trueflow.engine.interface import RolloutRequest
from trueflow.cli import main
from trueflow.engine.engine import Engine
from trueflow.engine.sampling_params import SamplingParams
from trueflow.engine.samplers import sde_log_prob
from trueflow.engine.snapshot import save_snapshot

DOC = Path(__file__).resolve().parents[1] / "docs" / "snapshot.md"
STEPS = 4


def generate(checkpoint: Path, out: Path, patch_group: str = "qwen_image") -> Path:
    snapshot = out / "s.safetensors"
    rc = main(["generate", "--checkpoint", str(checkpoint), "--prompt", "a red apple on a table", "--num-images", "4",
               "--sampler", "sde", "--patch-group", patch_group, "--seed", "7", "--steps", str(STEPS),
               "--snapshot", str(snapshot), "--out", str(out)])
    assert rc == 0
    return snapshot


def read(snapshot: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(snapshot), "pt") as f:
        meta = json.loads(f.metadata()["trueflow"])
    return load_file(str(snapshot)), meta


@pytest.fixture(scope="module")
def snapshot(tiny_checkpoint, tmp_path_factory) -> Path:
    return generate(tiny_checkpoint, tmp_path_factory.mktemp("generate"))


def test_generate_writes_images_settings_and_a_reproducible_snapshot(snapshot, tiny_checkpoint, tmp_path):
    out = snapshot.parent
    assert sorted(p.name for p in out.glob("*.png")) == ["0000.png", "0001.png", "0002.png", "0003.png"]
    settings = json.loads((out / "settings.json").read_text())
    assert settings["params"]["sampler"] == "sde" and settings["seed"] == 7
    assert settings["n_samples_per_prompt"] == 4  # the flag's name (it was num_images before the vocabulary was one)
    assert settings["engine"]["patch_group"] == "qwen_image" and settings["engine"]["weights_checksum"]
    again = generate(tiny_checkpoint, tmp_path)
    (first, meta), (second, meta2) = read(snapshot), read(again)
    assert meta == meta2 and first.keys() == second.keys()
    for key in first:
        assert_bitwise(second[key], first[key], key)
    assert (tmp_path / "0000.png").read_bytes() == (out / "0000.png").read_bytes()


def _key_pattern(doc_key: str) -> str:
    """`mg{m}/step{t}/noise` -> a regex of the concrete keys it documents."""
    return re.escape(doc_key).replace(r"\{m\}", r"\d+").replace(r"\{t\}", r"\d+")


def test_every_key_is_documented(snapshot):
    tensors, meta = read(snapshot)
    doc = DOC.read_text()
    rows = {k: (d.strip(), s) for k, d, s in re.findall(r"^\| `(mg\{m\}/[^`]+)` \| ([^|]+) \| `([^`]+)` \|", doc, re.M)}
    dtypes = {"latent dtype": torch.bfloat16, "fp32": torch.float32, "bool": torch.bool}
    dims = {"B": 4, "S": 16, "C": 64, "D": 48, "T": STEPS, "T+1": STEPS + 1}  # L, L' vary
    used = set()
    for key, value in tensors.items():
        matches = [k for k in rows if re.fullmatch(_key_pattern(k), key)]
        assert len(matches) == 1, f"{key} is not documented in docs/snapshot.md"
        dtype, shape = rows[matches[0]]
        used.add(matches[0])
        want = [dims.get(d.strip()) for d in shape.strip("[]").split(",") if d.strip()]
        assert dtypes[dtype] == value.dtype and len(want) == value.ndim, key
        assert all(w in (None, n) for w, n in zip(want, value.shape)), key
    # masks are absent (one prompt per microgroup), rewards too (`generate` does not score; the trainer's do)
    assert used == {k for k in rows if "mask" not in k and not k.endswith("/rewards")}
    for field in meta:
        assert f"| `{field}` |" in doc, f"metadata field {field} is not documented"


def test_a_step_replayed_with_diffusers_alone_is_the_record(snapshot, tiny_checkpoint, tmp_path):
    for t in (0, STEPS - 1):
        result = replay_snapshot_step(snapshot, 0, t)
        assert result == {"microgroup": 0, "step": t, "bitwise_equal": True, "max_abs_diff": 0.0}
    # the failing side: the engine's fast numerics are not diffusers'
    fast = generate(tiny_checkpoint, tmp_path, patch_group="none")
    assert replay_snapshot_step(fast, 0, 1)["bitwise_equal"] is False


def test_snapshot_rescoring_gives_the_recorded_log_prob_mean_and_std(snapshot):
    tensors, meta = read(snapshot)
    sigmas = tensors["mg0/sigmas"]
    for t in meta["microgroups"][0]["sde_steps"]:
        x_next = tensors[f"mg0/step{t + 1}/latents"] if t + 1 < STEPS else tensors["mg0/final_latents"]
        log_prob, mean, std = sde_log_prob(x_next, tensors[f"mg0/step{t}/latents"],
                                           tensors[f"mg0/step{t}/guided_output"], sigmas[t], sigmas[t + 1], sigmas[1],
                                           meta["params"]["noise_level"])
        assert_bitwise(log_prob, tensors["mg0/log_probs"][t], f"log-prob {t}")
        assert_bitwise(mean, tensors[f"mg0/step{t}/mean"], f"mean {t}")
        assert_bitwise(std, tensors[f"mg0/step{t}/std"], f"std {t}")
        stored = (mean + std * tensors[f"mg0/step{t}/noise"]).to(x_next.dtype)
        assert_bitwise(stored, x_next, f"x_next {t}")


def test_save_snapshot_needs_a_recorded_rollout(tiny_checkpoint, tmp_path):
    rollout = Engine(tiny_checkpoint).rollout(RolloutRequest(["x"], 1, SamplingParams(steps=2), seed=0, decode=False))
    with pytest.raises(ValueError, match="record_snapshot=True"):
        save_snapshot(rollout, tmp_path / "s.safetensors")


def test_generate_reports_bad_input(tiny_checkpoint, tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "x", "--resolution", "50",
                 "--out", str(tmp_path)]) == 2
    assert "multiple of 16" in capsys.readouterr().err
