"""Wan2.2 pipeline folders with seeded random weights, of the real `WanPipeline` layouts, built offline.

Two layouts, as diffusers' conversion (`scripts/convert_wan_to_diffusers.py`) saves the published checkpoints:
- A14B (`Wan-AI/Wan2.2-T2V-A14B-Diffusers`): `transformer` (high noise) and `transformer_2` (low noise), each seeded
  apart, `boundary_ratio` 0.875 in model_index.json, Wan2.1's VAE (z 16, 8x spatial), UniPC with flow_shift 3.0;
- TI2V-5B (`Wan-AI/Wan2.2-TI2V-5B-Diffusers`): one `transformer` (`transformer_2` null, no boundary),
  `expand_timesteps` true, Wan2.2's VAE (z 48, patch 2, residual, 16x spatial), UniPC with flow_shift 5.0.
Both: a UMT5 encoder as wide as the transformer's `text_dim` and a T5 (Unigram) tokenizer built from an in-memory
vocabulary (pad 0, eos 1, unk 2 as UMT5's; printable ASCII pieces).

The pipeline sizes everything from component configs and never checks them against each other: the VAE's z_dim is the
transformer's in_channels, its declared factors (`scale_factor_spatial` / `_temporal`) are what its decoder does
(8x: three 2x upsamples; 16x: those and the 2x patch; 4x temporal, keeping the causal first frame), and the text
encoder's width is the transformer's text_dim.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from diffusers import UniPCMultistepScheduler
# diffusers' model and pipeline classes from their defining modules: `diffusers`' own TYPE_CHECKING
# imports name its dummy classes first, so a checker sees those.
from diffusers.models import AutoencoderKLWan
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from ..random_init import init_weights_
from .presets import LAYOUT_OF_SIZE, build_transformer, transformer_config
from .scheduler_config import A14B_FLOW_SHIFT, TI2V_FLOW_SHIFT

BOUNDARY_RATIO = 0.875  # convert_wan_to_diffusers.py: WanPipeline(..., boundary_ratio=0.875) for Wan2.2 T2V

# Wan2.1's VAE (the A14B's) at 4 channels in every stage and one res block a stage: AutoencoderKLWan's structure
# otherwise (z 16, four stages: 8x spatial, temporal downsampling in the last two: 4x). Its causal Conv3d runs frame by
# frame, so even this one costs most of a tiny test's decode.
_VAE_A14B: dict[str, Any] = {"base_dim": 4, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
                             "temperal_downsample": [False, True, True]}
# Wan2.2's VAE (the TI2V-5B's, `vae22_diffusers_config` of the conversion) at small widths: z 48, residual blocks, a
# 2x patchify of 3 channels into 12, 16x spatial, 4x temporal, its 48 latents_mean / latents_std.
_VAE_TI2V: dict[str, Any] = {
    "base_dim": 4, "decoder_base_dim": 4, "z_dim": 48, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
    "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
    "patch_size": 2, "scale_factor_temporal": 4, "scale_factor_spatial": 16,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}


def build_tokenizer() -> T5Tokenizer:
    """A T5 Unigram tokenizer (UMT5's special ids: pad 0, eos 1, unk 2) over printable ASCII, word-initial pieces for
    the lowercase letters."""
    chars = [c for c in string.printable if c not in " \t\n\r\x0b\x0c"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)] + [(c, -3.0) for c in chars] + \
        [("▁" + c, -2.5) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def build_text_encoder(tokenizer: T5Tokenizer, d_model: int, seed: int) -> UMT5EncoderModel:
    """A two-layer UMT5 encoder `d_model` wide (the transformer's text_dim; UMT5-XXL: 4096) with seeded weights."""
    heads = 2 if d_model < 1024 else 64
    config = UMT5Config(vocab_size=-(-len(tokenizer) // 64) * 64, d_model=d_model, d_kv=d_model // heads,
                        d_ff=2 * d_model, num_layers=2, num_heads=heads, relative_attention_num_buckets=8,
                        relative_attention_max_distance=32, feed_forward_proj="gated-gelu", pad_token_id=0,
                        eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False)
    return init_weights_(UMT5EncoderModel(config), seed).eval()


def build_vae(layout: str, seed: int) -> AutoencoderKLWan:
    return init_weights_(AutoencoderKLWan(**(_VAE_A14B if layout == "a14b" else _VAE_TI2V)), seed).eval()


def build_pipeline(size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> WanPipeline:
    """A complete WanPipeline in memory of the layout of `size` (presets.LAYOUT_OF_SIZE): the transformer(s) in
    `dtype` on `device` (kept-fp32 parameters in fp32), the text encoder and the VAE fp32 on the CPU."""
    if size not in LAYOUT_OF_SIZE:
        transformer_config(size)  # the list of sizes
    layout = LAYOUT_OF_SIZE[size]
    tokenizer = build_tokenizer()
    experts = [build_transformer(size, seed + k, dtype, device) for k in range(2 if layout == "a14b" else 1)]
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000,
                                        flow_shift=A14B_FLOW_SHIFT if layout == "a14b" else TI2V_FLOW_SHIFT)
    # WanPipeline annotates its tokenizer as AutoTokenizer and its scheduler as the Euler one; it takes these
    return WanPipeline(
        tokenizer=tokenizer,  # type: ignore[arg-type]
        text_encoder=build_text_encoder(tokenizer, experts[0].config["text_dim"], seed + 2),
        vae=build_vae(layout, seed + 3),
        scheduler=scheduler,  # type: ignore[arg-type]
        transformer=experts[0],
        transformer_2=experts[1] if layout == "a14b" else None,
        boundary_ratio=BOUNDARY_RATIO if layout == "a14b" else None,
        expand_timesteps=layout == "ti2v",
    )


def write_checkpoint(out: Path, size: str, seed: int, dtype: torch.dtype, device: str | torch.device) -> None:
    """Save a pipeline folder that `WanPipeline.from_pretrained(out)` loads into the (empty) folder `out`;
    `trueflow.checkpoints.init_checkpoint` checks the arguments and moves the folder into place."""
    build_pipeline(size, seed, dtype, device).save_pretrained(out, safe_serialization=True)
