"""LTX-2.3 pipeline folders with seeded random weights, of the real `LTX2Pipeline` layout, built offline.

Components: the preset transformer; Gemma-3 (`Gemma3ForConditionalGeneration`, with its SigLIP vision tower, as the
real text encoder has) and a Gemma tokenizer built from an in-memory vocabulary (characters, the Gemma special tokens
at their real ids 0-3, byte fallback); the 2.3 text connectors (per-modality projections, gated attention, split
RoPE, learnable registers) sized to the transformer's two streams; a video VAE of the 2.3 structure at small widths;
the audio VAE; the 2.3 vocoder (with bandwidth extension); the scheduler.

The pipeline sizes everything from component configs and never checks them against each other, so a mismatch fails
silently (a VAE whose decoder upsamples less than its declared compression decodes 9 requested frames as 5). The
sizes below are tied together: the VAE's declared compression (32 px, 8 frames) equals what its decoder does (patch
4 x three 2x spatial upsamples; three 2x temporal upsamples, each keeping the causal first frame: 8(F-1)+1 frames);
its latent channels are the transformer's `in_channels`; the audio VAE's latent channels x latent mel bins are the
transformer's `audio_in_channels`; the connectors' outputs are the transformer's cross-attention widths.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, cast

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
# diffusers' model and pipeline classes from their defining modules: `diffusers`' own TYPE_CHECKING
# imports name its dummy classes first, so a checker sees those.
from diffusers.models import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

from .presets import build_seeded, build_transformer, seeded_init_
from .scheduler_config import LTX2_SCHEDULER_CONFIG

# Gemma's special tokens at their real ids (pad 0, eos 1, bos 2, unk 3, mask 4), then the image tokens the vision
# tower's prompts use.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>")

# Text encoder per width: (layers, query heads, kv heads, head dim). The tiny one is two narrow layers; the full
# transformer gets two layers of Gemma-3-12B's width (3840, 16 x 256 heads, 8 kv heads): a 48-layer text encoder
# would be 12B parameters of noise, and the connectors take any layer count (text_proj_in_factor = layers + 1).
_TEXT = {"tiny": (32, 2, 2, 1, 16), "full": (3840, 2, 16, 8, 256)}

# Connector layers: 2.3 has 8 per stream and 128 learnable registers (the padded text length must be a multiple of
# the register count, so the tiny one takes 8: any max_sequence_length that is a multiple of 8).
_CONNECTOR_LAYERS = {"tiny": (1, 8), "full": (8, 128)}

# The 2.3 video VAE's structure (diffusers' LTX-2.3 conversion config) at 4-8 channels and one layer a block (~89k
# parameters, 41k of them the decoder).
_VIDEO_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": (4, 4, 8, 8),
    "down_block_types": ("LTX2VideoDownBlock3D",) * 4,
    "decoder_block_out_channels": (4, 8, 8, 8),
    "layers_per_block": (1, 1, 1, 1, 1),
    "decoder_layers_per_block": (1, 1, 1, 1, 1),
    "spatio_temporal_scaling": (True, True, True, True),
    "decoder_spatio_temporal_scaling": (True, True, True, True),
    "decoder_inject_noise": (False,) * 5,
    "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    "upsample_type": ("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
    "upsample_residual": (False, False, False, False),
    "upsample_factor": (2, 2, 1, 2),
    "timestep_conditioning": False,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "encoder_causal": True,
    "decoder_causal": False,
    "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "zeros",
    "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 8,
}

# The audio VAE's real structure is (128 channels, ch_mult 1-2-4, 8 latent channels, 64 mel bins); this one keeps
# its sample rate, hop and causality. Latents: 2 channels x (8 mel bins / 4) = 4 = the tiny transformer's audio
# channels; the full transformer's 128 = 8 x 64/4 is the real audio VAE's.
_AUDIO_VAE: dict[str, Any] = {
    "base_channels": 4, "output_channels": 2, "ch_mult": (1,), "num_res_blocks": 1, "attn_resolutions": None,
    "in_channels": 2, "resolution": 32, "latent_channels": 2, "norm_type": "pixel", "causality_axis": "height",
    "dropout": 0.0, "mid_block_add_attention": False, "sample_rate": 16000, "mel_hop_length": 160, "is_causal": True,
    "mel_bins": 8, "double_z": True,
}

# The 2.3 vocoder (snake activations, anti-aliasing, a bandwidth-extension stage to 48 kHz) at small widths.
_VOCODER: dict[str, Any] = {
    "hidden_channels": 8, "out_channels": 2, "upsample_kernel_sizes": [4, 4], "upsample_factors": [2, 2],
    "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]], "act_fn": "snakebeta", "antialias": True,
    "antialias_ratio": 2, "antialias_kernel_size": 12, "final_act_fn": None, "final_bias": False,
    "bwe_hidden_channels": 8, "bwe_out_channels": 2, "bwe_upsample_kernel_sizes": [4, 4, 4],
    "bwe_upsample_factors": [2, 2, 2], "bwe_resnet_kernel_sizes": [3], "bwe_resnet_dilations": [[1, 3, 5]],
    "bwe_act_fn": "snakebeta", "bwe_antialias": True, "bwe_antialias_ratio": 2, "bwe_antialias_kernel_size": 12,
    "bwe_final_act_fn": None, "bwe_final_bias": False, "filter_length": 32, "hop_length": 4, "window_length": 32,
    "input_sampling_rate": 16000, "output_sampling_rate": 32000,
}


def build_tokenizer() -> GemmaTokenizer:
    """A Gemma tokenizer (left padding, bos added) over printable ASCII characters plus byte fallback."""
    chars = ["▁" if c == " " else c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for tok in chars + [f"<0x{b:02X}>" for b in range(256)]:
        vocab.setdefault(tok, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], extra_special_tokens=list(SPECIAL_TOKENS[5:]),
                          model_max_length=1024, padding_side="left")


def _text_size(transformer_config: dict) -> str:
    return "full" if transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"] >= 1024 \
        else "tiny"


def build_text_encoder(tokenizer: GemmaTokenizer, size: str, seed: int) -> Gemma3ForConditionalGeneration:
    """Gemma-3 with a SigLIP vision tower and seeded random weights, token ids matching `tokenizer`."""
    hidden, layers, heads, kv_heads, head_dim = _TEXT[size]
    ids = {tok: cast(int, tokenizer.convert_tokens_to_ids(tok)) for tok in SPECIAL_TOKENS}  # one token: one id
    config = Gemma3Config(
        text_config={
            "vocab_size": -(-len(tokenizer) // 64) * 64, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "query_pre_attn_scalar": head_dim, "sliding_window": 16,
            "max_position_embeddings": 4096, "pad_token_id": ids["<pad>"], "eos_token_id": ids["<eos>"],
            "bos_token_id": ids["<bos>"],
        },
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                       "vision_use_head": False},
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    return seeded_init_(Gemma3ForConditionalGeneration(config), seed).eval()


def build_connectors(transformer_config: dict, text_hidden: int, text_layers: int, size: str, seed: int,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LTX2TextConnectors:
    """The 2.3 connectors, each stream as wide as the transformer's (its heads, its head dims), in `dtype` on
    `device` (the full-size ones are 2B parameters)."""
    layers, registers = _CONNECTOR_LAYERS[size]
    tc = transformer_config
    return build_seeded(lambda: LTX2TextConnectors(
        caption_channels=text_hidden,
        text_proj_in_factor=text_layers + 1,
        video_connector_num_attention_heads=tc["num_attention_heads"],
        video_connector_attention_head_dim=tc["attention_head_dim"],
        video_connector_num_layers=layers,
        video_connector_num_learnable_registers=registers,
        video_gated_attn=True,
        audio_connector_num_attention_heads=tc["audio_num_attention_heads"],
        audio_connector_attention_head_dim=tc["audio_attention_head_dim"],
        audio_connector_num_layers=layers,
        audio_connector_num_learnable_registers=registers,
        audio_gated_attn=True,
        connector_rope_base_seq_len=4096,
        rope_theta=10000.0,
        rope_double_precision=True,
        causal_temporal_positioning=False,
        rope_type="split",
        per_modality_projections=True,
        video_hidden_dim=tc["cross_attention_dim"],
        audio_hidden_dim=tc["audio_cross_attention_dim"],
        proj_bias=True,
    ), seed, dtype, device)


def build_pipeline(size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", text_size: str | None = None) -> LTX2Pipeline:
    """A complete LTX2Pipeline in memory: the `size` transformer and the connectors in `dtype` on `device`, the
    text encoder in `dtype`, the VAEs and the vocoder fp32 on the CPU. `text_size` ("tiny"/"full") sizes the text
    encoder and the connectors' depth apart from the transformer (default: the transformer's size): a full-size
    transformer with a tiny text stack still gets connectors as wide as its streams, and fits a small disk."""
    transformer = build_transformer(size, seed, dtype, device)
    tc = dict(transformer.config)
    text_size = text_size or _text_size(tc)
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(tokenizer, text_size, seed + 1).to(dtype)  # type: ignore[arg-type]  # transformers' `@wraps` .to, typed unbound by typeshed
    text_cfg = text_encoder.config.text_config
    audio_vae_config = {**_AUDIO_VAE}
    if tc["audio_in_channels"] != 4:  # the real audio VAE's latent layout: 8 channels x 64/4 mel bins
        audio_vae_config.update(latent_channels=8, mel_bins=64)
    audio_vae = seeded_init_(AutoencoderKLLTX2Audio(**audio_vae_config), seed + 4).eval()
    vocoder_in = audio_vae.config.output_channels * audio_vae.config.mel_bins
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(LTX2_SCHEDULER_CONFIG),
        vae=seeded_init_(AutoencoderKLLTX2Video(latent_channels=tc["in_channels"], **_VIDEO_VAE), seed + 3).eval(),
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=build_connectors(tc, text_cfg.hidden_size, text_cfg.num_hidden_layers, text_size, seed + 2,
                                    dtype, device),
        transformer=transformer,
        vocoder=seeded_init_(LTX2VocoderWithBWE(in_channels=vocoder_in, bwe_in_channels=vocoder_in,
                                                num_mel_channels=audio_vae.config.mel_bins, **_VOCODER),
                             seed + 5).eval(),
    )


def write_checkpoint(out: Path, size: str, seed: int, dtype: torch.dtype, device: str | torch.device) -> None:
    """Save a pipeline folder that `LTX2Pipeline.from_pretrained(out)` loads into the (empty) folder `out`;
    `trueflow.checkpoints.init_checkpoint` checks the arguments and moves the folder into place."""
    build_pipeline(size, seed, dtype, device).save_pretrained(out, safe_serialization=True)
