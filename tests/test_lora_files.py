"""`--lora PATH [--ema]`: what it names (a run, a checkpoint, a PEFT folder, a file), the scale it applies (PEFT's and
diffusers' own, as the oracle), and the one-line refusals of what the family's engine cannot take."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from trueflow.cli import main
from trueflow.lora_files import COMPLETE, EMA_FILE, LORA_FILE, PEFT_FILE, check_lora, find_lora, resolve_lora
from trueflow.models import family_for_checkpoint, get_family

RANK = 4


@pytest.fixture(scope="module")
def lora(tiny) -> dict[str, torch.Tensor]:
    """A PEFT LoRA of the tiny Qwen-Image transformer (non-zero B), in PEFT's names, fp32 as a trainer saves it."""
    from trueflow.models.qwen_image.presets import build_transformer
    from trueflow.train.model import LoraSpec, add_lora, lora_state_dict

    config, _ = tiny
    model = build_transformer(config, seed=0, dtype=torch.float32)
    add_lora(model, LoraSpec(RANK, get_family("qwen_image").train.lora_targets), b_init_std=0.05, seed=1)
    return {k: v.float().contiguous() for k, v in lora_state_dict(model).items()}


def save_as_trainer(lora: dict, folder: Path, alpha: float | None = None, rslora: bool = False,
                    name: str = LORA_FILE) -> Path:
    """As train/checkpoint.py writes it: diffusers' `save_lora_weights` of the family's pipeline, PEFT's config as
    the adapter metadata (or, `alpha` None, no metadata at all: a bare PEFT file)."""
    from trueflow.train.model import LoraSpec

    folder.mkdir(parents=True, exist_ok=True)
    if alpha is None:
        save_file({f"transformer.{k}": v for k, v in lora.items()}, str(folder / name))
        return folder / name
    spec = LoraSpec(RANK, get_family("qwen_image").train.lora_targets, alpha, extra={"use_rslora": rslora})
    config = json.loads(json.dumps(spec.peft_config().to_dict(), default=lambda o: sorted(o) if isinstance(o, set)
                                   else str(o)))
    get_family("qwen_image").pipeline_type().save_lora_weights(folder, transformer_lora_layers=lora, weight_name=name,
                                                                transformer_lora_adapter_metadata=config)
    return folder / name


def peft_scaling(alpha: float, rslora: bool) -> float:
    """The oracle: the scale PEFT itself gives a rank-RANK adapter of that config."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)),
                           LoraConfig(r=RANK, lora_alpha=alpha, target_modules=["0"], use_rslora=rslora))
    return model.base_model.model[0].scaling["default"]


@pytest.mark.parametrize("alpha, rslora", [(RANK, False), (8.0, False), (8.0, True)])
def test_the_scale_is_the_one_peft_gives(lora, tiny_checkpoint, tmp_path, alpha, rslora):
    f = save_as_trainer(lora, tmp_path, alpha, rslora)
    got = check_lora(f, get_family("qwen_image"), tiny_checkpoint)
    assert (got.scale, got.rank, got.modules) == (peft_scaling(alpha, rslora), RANK, len(lora) // 2)


def test_a_file_without_a_config_has_diffusers_default_scale(lora, tiny_checkpoint, tmp_path):
    """No metadata, no adapter_config.json: alpha = rank, as diffusers' loader takes such a file."""
    from diffusers.utils.peft_utils import get_peft_kwargs

    f = save_as_trainer(lora, tmp_path, None)
    ranks = {k: v.shape[1] for k, v in lora.items() if ".lora_B." in k}
    kwargs = get_peft_kwargs(ranks, None, lora)
    assert check_lora(f, get_family("qwen_image"), tiny_checkpoint).scale == kwargs["lora_alpha"] / kwargs["r"] == 1.0
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": 2 * RANK}))  # PEFT's folder
    assert check_lora(f, get_family("qwen_image"), tiny_checkpoint).scale == 2.0


def make_run(root: Path, lora: dict, steps=(2, 4), ema_at=()) -> Path:
    for s in steps:
        d = root / "checkpoints" / f"step-{s:06d}"
        save_as_trainer(lora, d, float(RANK))
        if s in ema_at:
            save_as_trainer(lora, d, float(RANK), name=EMA_FILE)
        (d / COMPLETE).write_text("ok\n")
    (root / "checkpoints" / "latest").write_text(f"step-{steps[-1]:06d}\n")
    return root


def test_what_a_path_names(lora, tmp_path):
    run = make_run(tmp_path / "run", lora, ema_at=(4,))
    step4 = run / "checkpoints" / "step-000004"
    assert resolve_lora(str(run)) == step4 / LORA_FILE  # a run: its latest complete checkpoint
    assert resolve_lora(str(run), ema=True) == step4 / EMA_FILE
    assert resolve_lora(str(run / "checkpoints" / "step-000002")) == run / "checkpoints" / "step-000002" / LORA_FILE
    assert resolve_lora(str(step4 / LORA_FILE)) == step4 / LORA_FILE
    peft = tmp_path / "peft"
    peft.mkdir()
    save_file({f"base_model.model.{k}": v for k, v in lora.items()}, str(peft / PEFT_FILE))
    assert resolve_lora(str(peft)) == peft / PEFT_FILE


@pytest.mark.parametrize("case, fragment", [
    ("missing", "no such file or folder"),
    ("no checkpoint yet", "the run has no complete checkpoint yet"),
    ("incomplete", "an incomplete checkpoint"),
    ("no ema", "holds no EMA of the LoRA"),
    ("ema of a file", "--ema picks the EMA file of a checkpoint folder"),
    ("empty folder", "no LoRA in this folder"),
    ("not safetensors", "not a safetensors file"),
    ("not lora names", "are not PEFT LoRA tensors"),
    ("two ranks", "one rank and alpha for every module"),
    ("another family", "the ltx2 engine cannot map"),
    ("another family's names", "the qwen_image engine cannot map"),
    ("two trained experts", "the run trained the LoRA of transformer_2 too"),
])
def test_a_lora_the_engine_cannot_take_is_refused_in_one_line(lora, tiny_checkpoint, ltx2_checkpoint, tmp_path,
                                                               case, fragment):
    ckpt, ema, path = tiny_checkpoint, False, tmp_path / "x"
    if case == "no checkpoint yet":
        (path / "checkpoints").mkdir(parents=True)
    elif case == "incomplete":
        make_run(path, lora)
        (path / "checkpoints" / "step-000004" / COMPLETE).unlink()
        path = path / "checkpoints" / "step-000004"
    elif case == "no ema":
        make_run(path, lora)
        ema = True
    elif case == "ema of a file":
        path, ema = save_as_trainer(lora, path), True
    elif case == "empty folder":
        path.mkdir()
    elif case == "not safetensors":
        path.write_bytes(b"\xff" * 64)
    elif case == "not lora names":
        save_file({"transformer_blocks.0.attn.to_q.weight": torch.zeros(2, 2), **lora}, str(path))
    elif case == "two ranks":
        name = next(k for k in lora if ".lora_A." in k)
        save_file({**lora, name: torch.zeros(RANK + 1, lora[name].shape[1]),
                   name.replace("lora_A", "lora_B"): torch.zeros(lora[name.replace("lora_A", "lora_B")].shape[0],
                                                                RANK + 1)}, str(path))
    elif case == "another family":  # a Qwen-Image LoRA on an LTX-2.3 engine
        path, ckpt = save_as_trainer(lora, path), ltx2_checkpoint
    elif case == "another family's names":  # LTX-2.3's `attn1.to_q`: a suffix PEFT's rule alone would let through
        save_file({"transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(RANK, 32),
                   "transformer_blocks.0.attn1.to_q.lora_B.weight": torch.zeros(32, RANK)}, str(path))
    elif case == "two trained experts":  # a Wan2.2-A14B run's checkpoint: transformer_2's LoRA in a file of its own
        make_run(path, lora)
        (path / "checkpoints" / "step-000004" / "trainer_state.json").write_text(json.dumps(
            {"step": 4, "experts": ["transformer", "transformer_2"], "lora_experts": ["transformer", "transformer_2"]}))
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        find_lora(str(path), ema, family_for_checkpoint(ckpt), ckpt)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_generate_refuses_a_bad_lora_before_loading_in_one_line(tiny_checkpoint, tmp_path, capsys):
    for extra, fragment in ((["--lora", str(tmp_path / "nope")], "no such file or folder"),
                            (["--ema"], "--ema picks a checkpoint's EMA twin: give --lora")):
        rc = main(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "p", "--output-dir",
                   str(tmp_path / "g"), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "g").exists()


def test_generate_runs_the_engine_with_the_files_lora_and_scale(lora, tiny_checkpoint, tmp_path):
    """alpha = 2 x rank: the engine must get the LoRA with scale 2 (what an Engine given it directly draws)."""
    from safetensors.torch import load_file

    from trueflow.engine.engine import Engine
    from trueflow.engine.request import RolloutRequest
    from trueflow.engine.sampling_params import SamplingParams

    f = save_as_trainer(lora, tmp_path / "ckpt", alpha=2.0 * RANK)
    assert main(["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "a red cube", "--steps", "2",
                 "--sampler", "ode", "--seed", "3", "--lora", str(f), "--output-dir", str(tmp_path / "g")]) == 0
    got = np.asarray(Image.open(tmp_path / "g" / "0000.png"))
    engine = Engine(tiny_checkpoint, "qwen_image")
    params = SamplingParams(steps=2, sampler="ode")
    request = RolloutRequest(["a red cube"], 1, params, 3)
    base = engine.rollout(request).images[0].numpy()
    engine.update_weights(load_file(str(f)), 2.0)
    assert np.array_equal(got, engine.rollout(request).images[0].numpy())
    assert not np.array_equal(got, base)
    engine.update_weights(load_file(str(f)), 1.0)  # the failing side: another scale draws other pixels
    assert not np.array_equal(got, engine.rollout(request).images[0].numpy())
    settings = json.loads((tmp_path / "g" / "settings.json").read_text())
    assert settings["lora"]["scale"] == 2.0 and settings["engine"]["patch_group"] == "qwen_image"
    assert math.isclose(settings["lora"]["scale"], peft_scaling(2.0 * RANK, False))
