"""FLUX.1 pipeline folders with seeded random weights, of the real `FluxPipeline` layout, built offline.

Components, each transformers' / diffusers' own class: the preset transformer; CLIP's text tower (`CLIPTextModel`)
with a CLIP tokenizer (byte-level BPE with the end-of-word suffix, no merges: every character a token, the special
tokens at the top of the vocabulary as in CLIP's, so the model's legacy end-of-text lookup by argmax finds them), T5's
encoder (`T5EncoderModel`, gated-GELU as T5 v1.1) with a T5 unigram tokenizer over characters, the 100 sentinel
tokens included; a small `AutoencoderKL` of FLUX's structure (4 levels: factor 8, 16 latent channels, no quant
convs, FLUX's scaling and shift factors); the scheduler. Nothing is downloaded.

The text widths are the transformer's: T5's `d_model` is its `joint_attention_dim`, CLIP's hidden size its
`pooled_projection_dim` (the full transformer gets one-layer encoders of the real widths, 4096 and 768).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
# diffusers' model and pipeline classes from their defining modules: `diffusers`' own TYPE_CHECKING
# imports name its dummy classes first, so a checker sees those.
from diffusers.models import AutoencoderKL
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from tokenizers import pre_tokenizers
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

from ..random_init import init_weights_
from .presets import build_transformer
from .prompts import MAX_TEXT_TOKENS
from .scheduler_config import FLUX_SCHEDULER_CONFIG

CLIP_MAX_LENGTH = 77  # CLIP's window: FluxPipeline's `tokenizer_max_length`
CLIP_SPECIAL = ("<|startoftext|>", "<|endoftext|>")

# FLUX.1's VAE (AutoencoderKL: 4 levels, 16 latent channels, scaling 0.3611, shift 0.1159, no quant convs) at a
# small width.
_VAE = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (4, 8, 8, 8), "layers_per_block": 1,
    "norm_num_groups": 4, "latent_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159,
    "use_quant_conv": False, "use_post_quant_conv": False, "sample_size": 1024,
}


def build_clip_tokenizer() -> CLIPTokenizer:
    """CLIP's tokenizer over the byte-level alphabet, each symbol also with CLIP's `</w>` end-of-word suffix."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([*alphabet, *(a + "</w>" for a in alphabet), *CLIP_SPECIAL])}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def build_t5_tokenizer() -> T5Tokenizer:
    """T5's unigram tokenizer (pad 0, eos 1, unk 2, as T5's) over printable characters, each alone and after the
    word-start marker `▁`."""
    chars = [c for c in string.printable if not c.isspace()]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(p, -3.0) for c in chars for p in ("▁" + c, c)]
    return T5Tokenizer(vocab=pieces, extra_ids=100, model_max_length=MAX_TEXT_TOKENS)


def build_clip(tokenizer: CLIPTokenizer, hidden: int, layers: int, seed: int) -> CLIPTextModel:
    """CLIP's text tower with seeded random weights; ids as the real config has them (bos 0, pad 1, eos 2: the
    legacy values that make the model take the pooled state at the highest id, the end-of-text token)."""
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH,
                            hidden_act="quick_gelu", projection_dim=hidden, bos_token_id=0, pad_token_id=1,
                            eos_token_id=2)
    return init_weights_(CLIPTextModel(config), seed).eval()


def build_t5(tokenizer: T5Tokenizer, d_model: int, layers: int, seed: int) -> T5EncoderModel:
    """T5 v1.1's encoder (gated GELU, untied embeddings) with seeded random weights."""
    # transformers' T5Config takes the legacy kwargs tie_word_embeddings/decoder_start_token_id (__post_init__), untyped
    config = T5Config(vocab_size=-(-len(tokenizer) // 64) * 64, d_model=d_model, d_kv=max(d_model // 2, 8),  # type: ignore[call-arg]
                      d_ff=2 * d_model, num_layers=layers, num_heads=2, feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return init_weights_(T5EncoderModel(config), seed).eval()


def build_pipeline(size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> FluxPipeline:
    """A complete FluxPipeline in memory: the `size` transformer in `dtype` on `device`, the text encoders and the
    VAE fp32 on the CPU (two layers each for the tiny transformer, one at the full widths)."""
    transformer = build_transformer(size, seed, dtype, device)
    tc = transformer.config
    layers = 2 if tc["joint_attention_dim"] < 1024 else 1
    clip_tokenizer, t5_tokenizer = build_clip_tokenizer(), build_t5_tokenizer()
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(FLUX_SCHEDULER_CONFIG),
        vae=init_weights_(AutoencoderKL(**_VAE), seed + 1).eval(),
        text_encoder=build_clip(clip_tokenizer, tc["pooled_projection_dim"], layers, seed + 2),
        tokenizer=clip_tokenizer,
        text_encoder_2=build_t5(t5_tokenizer, tc["joint_attention_dim"], layers, seed + 3),
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def write_checkpoint(out: Path, size: str, seed: int, dtype: torch.dtype, device: str | torch.device) -> None:
    """Save a pipeline folder that `FluxPipeline.from_pretrained(out)` loads into the (empty) folder `out`;
    `trueflow.checkpoints.init_checkpoint` checks the arguments and moves the folder into place."""
    build_pipeline(size, seed, dtype, device).save_pretrained(out, safe_serialization=True)
