"""SD3.5 pipeline folders with seeded random weights, of the real `StableDiffusion3Pipeline` layout, built offline.

Components: the preset transformer; CLIP-L and CLIP-G (`CLIPTextModelWithProjection`, two layers each) and T5
(`T5EncoderModel`, two layers, gated GELU as T5 v1.1), each with a tokenizer built from an in-memory vocabulary
(byte-level BPE characters for the CLIPs, padded to 77 tokens, CLIP-G padding with "!" as SD3's tokenizer_2 does; a
Unigram over printable characters for T5); a small `AutoencoderKL` of the SD3 structure (four stages, so the VAE
factor is 8; 16 latent channels; SD3's scaling and shift factors; no quant convs); the scheduler.

The pipeline sizes its inputs from the component configs and checks them against nothing, so they are tied here: the
two CLIPs' projections add up to the transformer's `pooled_projection_dim`, their widths fit in T5's, and T5's width
is the transformer's `joint_attention_dim` (the pipeline pads the CLIP embeddings to it).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
# diffusers' model and pipeline classes from their defining modules: `diffusers`' own TYPE_CHECKING
# imports name its dummy classes first, so a checker sees those.
from diffusers.models import AutoencoderKL
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline
from tokenizers import pre_tokenizers
# transformers' T5TokenizerFast (what the pipeline names) is T5Tokenizer (one tokenizers-backed class)
from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel,
                          T5Tokenizer)

from ..random_init import init_weights_
from .presets import build_transformer
from .scheduler_config import SD3_SCHEDULER_CONFIG

CLIP_MAX_LENGTH = 77  # the CLIP tokenizers' model_max_length: every CLIP embedding is 77 tokens
TEXT_LAYERS = 2  # each text encoder: enough for CLIP's penultimate hidden state, cheap at the real widths

# SD3's VAE (stabilityai/stable-diffusion-3.5-medium vae/config.json: 16 latent channels, four stages, scaling
# 1.5305, shift 0.0609, no quant convs) at a small width.
_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (8, 8, 16, 16), "layers_per_block": 1, "norm_num_groups": 4, "act_fn": "silu",
    "sample_size": 64, "scaling_factor": 1.5305, "shift_factor": 0.0609, "use_quant_conv": False,
    "use_post_quant_conv": False,
}


def build_clip_tokenizer(pad_token: str = "<|endoftext|>") -> CLIPTokenizer:
    """CLIP's byte-level BPE over single characters (each also as a word end, `</w>`), no merges, its special tokens
    last as in the real vocabulary (so eos is not id 2, which transformers would take for a legacy config)."""
    chars = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level characters
    vocab = {tok: i for i, tok in enumerate(chars + [c + "</w>" for c in chars])}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], pad_token=pad_token, model_max_length=CLIP_MAX_LENGTH)


def build_t5_tokenizer() -> T5Tokenizer:
    """T5's Unigram (pad 0, eos 1, unk 2 as the real one) over printable characters, each with and without the
    word-start marker; no sentinel tokens."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for c in string.ascii_letters + string.digits + string.punctuation:
        pieces += [("▁" + c, -3.0), (c, -4.0)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def _heads(width: int) -> int:
    return width // 64 if width >= 128 else 2


def text_widths(transformer_config: dict) -> tuple[int, int, int]:
    """(CLIP-L width, CLIP-G width, T5 width) for a transformer: SD3's 768 and 1280 where the pooled projection is
    2048, else half each; T5 as wide as the joint attention input."""
    pooled = transformer_config["pooled_projection_dim"]
    first = 768 if pooled == 2048 else pooled // 2
    widths = first, pooled - first, transformer_config["joint_attention_dim"]
    if widths[0] + widths[1] > widths[2]:
        raise ValueError(f"the CLIP widths {widths[:2]} do not fit in joint_attention_dim {widths[2]}: the pipeline "
                         "pads the concatenated CLIP embeddings to T5's width")
    return widths


def build_clip(tokenizer: CLIPTokenizer, width: int, act: str, seed: int) -> CLIPTextModelWithProjection:
    """A two-layer CLIP text model with projection (projection as wide as the model, as CLIP-L's and CLIP-G's)."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=4 * width, projection_dim=width,
        num_hidden_layers=TEXT_LAYERS, num_attention_heads=_heads(width), max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act=act, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return init_weights_(CLIPTextModelWithProjection(config), seed).eval()


def build_t5(tokenizer: T5Tokenizer, width: int, seed: int) -> T5EncoderModel:
    """A two-layer T5 v1.1 encoder (gated GELU, no biases) of `width`, d_ff 2.5x as T5-XXL's 10240/4096."""
    heads = _heads(width)
    config = T5Config(  # type: ignore[call-arg]  # transformers' T5Config takes these legacy kwargs (__post_init__), untyped
        vocab_size=-(-len(tokenizer) // 64) * 64, d_model=width, d_kv=width // heads, d_ff=5 * width // 2,
        num_layers=TEXT_LAYERS, num_heads=heads, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id)
    return init_weights_(T5EncoderModel(config), seed).eval()


def build_pipeline(size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> StableDiffusion3Pipeline:
    """A complete pipeline in memory: the `size` transformer (= presets.build_transformer(size, seed, dtype,
    device)) with a small VAE and two-layer text encoders of the widths it reads (fp32, CPU)."""
    transformer = build_transformer(size, seed, dtype, device)
    l_width, g_width, t5_width = text_widths(dict(transformer.config))
    tokenizer, tokenizer_2, tokenizer_3 = build_clip_tokenizer(), build_clip_tokenizer(pad_token="!"), \
        build_t5_tokenizer()
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(SD3_SCHEDULER_CONFIG),
        vae=init_weights_(AutoencoderKL(**_VAE), seed + 1).eval(),
        text_encoder=build_clip(tokenizer, l_width, "quick_gelu", seed + 2),
        tokenizer=tokenizer,
        text_encoder_2=build_clip(tokenizer_2, g_width, "gelu", seed + 3),
        tokenizer_2=tokenizer_2,
        text_encoder_3=build_t5(tokenizer_3, t5_width, seed + 4),
        tokenizer_3=tokenizer_3,
    )


def write_checkpoint(out: Path, size: str, seed: int, dtype: torch.dtype, device: str | torch.device) -> None:
    """Save a pipeline folder that `StableDiffusion3Pipeline.from_pretrained(out)` loads into the (empty) folder
    `out`; `trueflow.checkpoints.init_checkpoint` checks the arguments and moves the folder into place."""
    build_pipeline(size, seed, dtype, device).save_pretrained(out, safe_serialization=True)
