"""Tiny Qwen-Image checkpoints load and run through the stock diffusers pipeline; presets have the real shapes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from safetensors.torch import load_file
from transformers import Qwen2Tokenizer

from trueflow.checkpoints import init_checkpoint
from trueflow.models.qwen_image.presets import TRANSFORMER_CONFIGS, build_transformer, transformer_config

TRANSFORMER_FILE = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def pipe(ckpt: Path) -> QwenImagePipeline:
    return QwenImagePipeline.from_pretrained(ckpt)


def test_layout_and_classes(ckpt: Path) -> None:
    index = json.loads((ckpt / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert {k: v for k, v in index.items() if not k.startswith("_")} == {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    for f in ("transformer/config.json", TRANSFORMER_FILE, "vae/diffusion_pytorch_model.safetensors",
              "text_encoder/model.safetensors", "tokenizer/tokenizer.json", "scheduler/scheduler_config.json"):
        assert (ckpt / f).is_file(), f
    assert not list(ckpt.parent.glob(".tiny.*")), "temporary build folder left behind"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    assert size < 20 * 2**20


def test_component_configs(pipe: QwenImagePipeline) -> None:
    tiny = transformer_config("tiny")
    assert {k: pipe.transformer.config[k] for k in tiny} == {**tiny, "axes_dims_rope": list(tiny["axes_dims_rope"])}
    assert pipe.vae_scale_factor == 8 and pipe.vae.config.z_dim == 16
    assert len(pipe.vae.config.latents_mean) == len(pipe.vae.config.latents_std) == 16
    text = pipe.text_encoder.config.text_config
    assert text.hidden_size == tiny["joint_attention_dim"]
    assert text.vocab_size >= len(pipe.tokenizer)
    assert pipe.text_encoder.config.image_token_id == pipe.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    sched = pipe.scheduler.config
    assert sched.use_dynamic_shifting and sched.time_shift_type == "exponential"
    assert (sched.base_shift, sched.max_shift, sched.base_image_seq_len, sched.max_image_seq_len,
            sched.shift_terminal) == (0.5, 0.9, 256, 8192, 0.02)


def test_template_prefix_is_the_dropped_tokens(ckpt: Path, pipe: QwenImagePipeline) -> None:
    # The template and drop count come from the installed pipeline, so a diffusers change shows up here.
    tok = Qwen2Tokenizer.from_pretrained(ckpt / "tokenizer")
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert pipe.prompt_template_encode_start_idx == 34
    assert len(tok(prefix).input_ids) == 34
    prompt = "a red cube on a wooden table"
    n_full = len(tok(pipe.prompt_template_encode.format(prompt)).input_ids)
    embeds, mask = pipe.encode_prompt(prompt, device=torch.device("cpu"))
    assert embeds.shape == (1, n_full - 34, 48) and mask is None  # mask is dropped when nothing is padded
    # A batch pads the shorter prompt's embeddings with zeros and returns the mask.
    embeds, mask = pipe.encode_prompt([prompt, "a cat"], device=torch.device("cpu"))
    assert embeds.shape[1] == n_full - 34 and mask[0].all() and not mask[1].all()
    assert (embeds[1][~mask[1].bool()] == 0).all()


def test_pipeline_generates_an_image(pipe: QwenImagePipeline) -> None:
    def run() -> np.ndarray:
        out = pipe("a red cube on a wooden table", height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0,
                   generator=torch.Generator().manual_seed(0), output_type="pil")
        (image,) = out.images
        assert image.size == (64, 64)
        return np.asarray(image)

    pixels = run()
    assert np.isfinite(pixels).all() and pixels.std() > 1  # random weights, but not a constant image
    np.testing.assert_array_equal(run(), pixels)


def test_same_seed_same_bytes(ckpt: Path, tmp_path: Path) -> None:
    again = init_checkpoint(tmp_path / "again", seed=0)
    for f in ckpt.rglob("*"):
        if f.is_file():
            assert (again / f.relative_to(ckpt)).read_bytes() == f.read_bytes(), f
    other = init_checkpoint(tmp_path / "other", seed=1)
    assert (other / TRANSFORMER_FILE).read_bytes() != (ckpt / TRANSFORMER_FILE).read_bytes()


def test_in_memory_transformer_matches_disk(ckpt: Path) -> None:
    on_disk = load_file(ckpt / TRANSFORMER_FILE)
    for dtype in (torch.float32, torch.bfloat16):
        # Seeded values are drawn in fp32 and rounded once, as from_pretrained(torch_dtype=...) rounds the file.
        model = build_transformer("tiny", seed=0, dtype=dtype)
        state = model.state_dict()
        assert state.keys() == on_disk.keys()
        for name, value in on_disk.items():
            assert torch.equal(state[name], value.to(dtype)), name


def test_write_guards(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="overwrite=True"):
        init_checkpoint(ckpt)
    out = init_checkpoint(tmp_path / "ck", seed=0)
    assert init_checkpoint(out, seed=1, overwrite=True) == out
    assert (out / TRANSFORMER_FILE).read_bytes() != (ckpt / TRANSFORMER_FILE).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    with pytest.raises(ValueError, match="known sizes: tiny, full, one_block"):
        init_checkpoint(tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match="valid families: flux, ltx2, qwen_image"):
        init_checkpoint(tmp_path / "x", family="nosuch")


def test_full_config_is_the_real_transformer() -> None:
    full = transformer_config("full")
    assert full == {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                    "axes_dims_rope": (16, 56, 56), "guidance_embeds": False}
    assert transformer_config("one_block") == {**full, "num_layers": 1}
    full["num_layers"] = 0  # a copy: the preset is untouched
    assert TRANSFORMER_CONFIGS["full"]["num_layers"] == 60
    with pytest.raises(ValueError, match="known sizes"):
        transformer_config("huge")
    with torch.device("meta"):  # shapes only, no memory
        model = QwenImageTransformer2DModel(**transformer_config("full"))
    assert 20.0e9 < sum(p.numel() for p in model.parameters()) < 20.6e9


def test_one_block_has_real_width() -> None:
    model = build_transformer("one_block", seed=0, dtype=torch.bfloat16)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(model.transformer_blocks) == 1
    assert shapes["img_in.weight"] == (3072, 64)
    assert shapes["txt_in.weight"] == (3072, 3584)
    assert shapes["txt_norm.weight"] == (3584,)
    assert shapes["transformer_blocks.0.attn.to_q.weight"] == (3072, 3072)
    assert shapes["transformer_blocks.0.attn.norm_q.weight"] == (128,)
    assert shapes["transformer_blocks.0.img_mlp.net.0.proj.weight"] == (12288, 3072)
    assert shapes["transformer_blocks.0.img_mod.1.weight"] == (6 * 3072, 3072)
    assert shapes["proj_out.weight"] == (2 * 2 * 16, 3072)
    # Norm scales sit around 1 and biases are random, so neither is a no-op.
    assert abs(model.txt_norm.weight.float().mean().item() - 1.0) < 0.02
    assert model.txt_norm.weight.float().std().item() > 0.05
    assert model.img_in.bias.float().std() > 0.01


def test_a_full_width_text_encoder_pairs_with_the_full_transformer() -> None:
    """`--size full` writes a two-layer text encoder of the real width (3584, head_dim 128) so the pipeline's
    shapes line up; built and run here (the 20B transformer itself is drawn on a GPU)."""
    from trueflow.models.qwen_image.checkpoint import _build_text_encoder, build_tokenizer

    tokenizer = build_tokenizer()
    te = _build_text_encoder(tokenizer, 3584, seed=0)
    ids = tokenizer(["a red cube"], return_tensors="pt")
    with torch.no_grad():
        hidden = te(**ids, output_hidden_states=True).hidden_states[-1]
    assert hidden.shape[-1] == 3584 and torch.isfinite(hidden).all()
    with pytest.raises(ValueError, match="no text-encoder layout"):
        _build_text_encoder(tokenizer, 100, seed=0)
