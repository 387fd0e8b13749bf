"""Tiny Qwen-Image checkpoints: a diffusers pipeline folder of the real layout with seeded random weights.

Nothing can be downloaded here, so tests and benchmarks load these through the same code path as a real
checkpoint (`QwenImagePipeline.from_pretrained`). Only the tokenizer is trained rather than random: it is a
byte-level BPE fitted on a small embedded corpus so that the pipeline's chat-template prefix encodes to exactly
`prompt_template_encode_start_idx` tokens, the count the pipeline drops from the text encoder's output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
# diffusers' model and pipeline classes from their defining modules: `diffusers`' own TYPE_CHECKING
# imports name its dummy classes first, so a checker sees those.
from diffusers.models import AutoencoderKLQwenImage
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from ..random_init import init_weights_
from .presets import build_transformer
from .prompts import PROMPT_TEMPLATE, PROMPT_TEMPLATE_START_IDX
from .schedule import QWEN_IMAGE_SCHEDULER_CONFIG

# Text-encoder attention layout per hidden size (= the transformer's joint_attention_dim): (query heads, kv heads,
# mrope_section); mrope_section must sum to head_dim / 2. 3584 is the real Qwen2.5-VL-7B's layout (head_dim 128),
# so the full-size transformer gets a two-layer text encoder of the real width.
_TEXT_HEADS = {48: (2, 1, [4, 4, 4]), 3584: (28, 4, [16, 24, 24])}


# Qwen2.5-VL's special tokens in their real id order (151643.. there), appended after the BPE vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

_CORPUS = """\
A photo of a red apple on a wooden table next to a glass of water.
A small black cat sleeping on a blue sofa in a sunny living room.
An old lighthouse on a rocky coast at sunset, with waves crashing below.
A bowl of green salad with tomatoes, cucumbers and slices of yellow pepper.
A city street at night, wet from the rain, with bright neon signs and people walking.
A white dog running across a field of tall grass under a cloudy sky.
A wooden sign that says "Welcome" hanging above the door of a small shop.
Two children building a sand castle on the beach while their parents watch.
A mountain lake reflecting snowy peaks, pine trees along the shore, early morning light.
A red sports car parked in front of a modern glass building.
A cup of coffee with latte art, a croissant and a newspaper on a cafe table.
A portrait of an elderly man with a grey beard and a warm smile, soft studio lighting.
A watercolor painting of a garden full of flowers: roses, tulips and sunflowers.
A poster with large bold text that reads "Hello World" in orange letters.
Three colorful hot air balloons floating over green hills and a river.
A close-up of a butterfly with bright patterns resting on a purple flower.
A cozy bedroom with a large window, white curtains and a stack of books on the floor.
The quick brown fox jumps over the lazy dog.
A futuristic robot holding an umbrella in the snow, cinematic, highly detailed.
A square wooden box with round metal handles and a smooth, shiny texture.
"""

# hidden_size is set from the transformer's joint_attention_dim: the pipeline feeds the last hidden state to it.
_TEXT_ENCODER: dict[str, Any] = {
    "text_config": {
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,  # grouped-query attention, as the real 28 q / 4 kv heads
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        # mrope_section must sum to head_dim / 2 (real: 128 -> [16, 24, 24]); here head_dim is 24.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 4, 4]},
        "tie_word_embeddings": False,
    },
    # Unused by text-to-image, but Qwen2_5_VLForConditionalGeneration always owns a vision tower.
    "vision_config": {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
    },
}

# Real Qwen-Image VAE structure (3 down/up stages -> vae_scale_factor 8, z_dim 16) at a small width.
_VAE = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
}


def template_prefix() -> str:
    """The part of the pipeline's chat template before the prompt; the pipeline drops its tokens."""
    return PROMPT_TEMPLATE.split("{}")[0]


def build_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE with Qwen2's pre-tokenizer, trained on the embedded corpus plus the chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    # Special tokens are added tokens, never BPE pieces, so they are cut out of the training text. The template is
    # repeated so that each of its words wins a full merge chain and becomes one token, as in the real vocabulary.
    template_text = re.sub("|".join(map(re.escape, SPECIAL_TOKENS)), "", PROMPT_TEMPLATE.format(""))
    # vocab_size is only a cap: the small corpus runs out of merges first (~800 tokens).
    trainer = trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator([template_text] * 16 + _CORPUS.splitlines(), trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(SPECIAL_TOKENS)})

    # Named tokens as in Qwen2.5-VL's tokenizer_config.json.
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        # transformers types merges as "a b" strings and unk_token as a str; its tokenizers backend takes these
        merges=[tuple(m) for m in model["merges"]],  # type: ignore[misc]
        unk_token=None,  # type: ignore[arg-type]
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    n_prefix = len(tokenizer(template_prefix()).input_ids)
    if n_prefix != PROMPT_TEMPLATE_START_IDX:
        raise AssertionError(
            f"template prefix encodes to {n_prefix} tokens, the pipeline drops {PROMPT_TEMPLATE_START_IDX}"
        )
    return tokenizer


def _build_text_encoder(tokenizer: Qwen2Tokenizer, hidden_size: int, seed: int) -> Qwen2_5_VLForConditionalGeneration:
    """Tiny Qwen2.5-VL with seeded random weights whose token ids match `tokenizer`."""
    ids = {tok: cast(int, tokenizer.convert_tokens_to_ids(tok)) for tok in SPECIAL_TOKENS}  # one token: one id
    if hidden_size not in _TEXT_HEADS:
        raise ValueError(f"no text-encoder layout for joint_attention_dim {hidden_size}; known: {sorted(_TEXT_HEADS)}")
    heads, kv_heads, mrope = _TEXT_HEADS[hidden_size]
    text_config: dict[str, Any] = {
        **_TEXT_ENCODER["text_config"],
        "hidden_size": hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rope_parameters": {**_TEXT_ENCODER["text_config"]["rope_parameters"], "mrope_section": mrope},
        "vocab_size": -(-len(tokenizer) // 64) * 64,  # padded to a multiple of 64, as the real 152064
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    vision_config = {**_TEXT_ENCODER["vision_config"], "out_hidden_size": hidden_size}
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    return init_weights_(Qwen2_5_VLForConditionalGeneration(config), seed).eval()


def build_pipeline(size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> QwenImagePipeline:
    """A complete pipeline in memory: the `size` transformer (= configs.build_transformer(size, seed, dtype,
    device)) with a tiny VAE and a two-layer text encoder of the transformer's joint width (fp32, CPU)."""
    transformer = build_transformer(size, seed, dtype, device)
    tokenizer = build_tokenizer()
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=init_weights_(AutoencoderKLQwenImage(**_VAE), seed + 1).eval(),
        text_encoder=_build_text_encoder(tokenizer, transformer.config["joint_attention_dim"], seed + 2),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def write_checkpoint(out: Path, size: str, seed: int, dtype: torch.dtype, device: str | torch.device) -> None:
    """Save a pipeline folder that `QwenImagePipeline.from_pretrained(out)` loads into the (empty) folder `out`;
    `trueflow.checkpoints.init_checkpoint` checks the arguments and moves the folder into place."""
    build_pipeline(size, seed, dtype, device).save_pretrained(out, safe_serialization=True)
