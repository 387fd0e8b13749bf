"""Prompt encoding, bitwise as `FluxPipeline.encode_prompt` computes it (text encoding is not the DiT: the engine
runs transformers' own modules here).

What the pipeline does (diffusers 0.42.1, `_get_clip_prompt_embeds` and `_get_t5_prompt_embeds`), with no attention
mask on either encoder:
- CLIP (`CLIPTextModel`, `tokenizer`): the prompt padded to exactly `tokenizer.model_max_length` (77) tokens
  (`padding="max_length"`, truncation), and the model's `pooler_output` (the hidden state at the end-of-text token),
  cast to the text encoder's dtype: `pooled_projections` [B, 768].
- T5 (`T5EncoderModel`, `tokenizer_2`): the prompt padded to exactly `max_sequence_length` tokens (512 by default,
  the pipeline's cap), every position fed to the transformer, pad tokens included: `encoder_hidden_states`
  [B, max_sequence_length, 4096] in the T5 encoder's dtype.
So every prompt of a batch has one text length, the whole window, and no mask. The trainer never re-encodes: it
re-scores with the embeddings the engine recorded (parity condition 7, docs/patch-group.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ...collate import Cond

if TYPE_CHECKING:  # the classes load transformers' model code; callers pass built objects
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

MAX_TEXT_TOKENS = 512  # FluxPipeline.check_inputs: "`max_sequence_length` cannot be greater than 512"


class TextModule(nn.Module):
    """CLIP's text tower and T5's encoder, the two modules `encode_prompts` runs (the pipeline's `text_encoder` and
    `text_encoder_2`)."""

    def __init__(self, text_encoder: CLIPTextModel, text_encoder_2: T5EncoderModel):
        super().__init__()
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2


def load_text(root: str | Path, device: torch.device | str,
              dtype: torch.dtype) -> tuple[tuple["CLIPTokenizer", "T5Tokenizer"], TextModule]:
    """The checkpoint's two tokenizers, and its two text encoders in `dtype` on `device` (eval mode)."""
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    root = Path(root)
    tokenizers = AutoTokenizer.from_pretrained(root / "tokenizer"), AutoTokenizer.from_pretrained(root / "tokenizer_2")
    module = TextModule(CLIPTextModel.from_pretrained(root / "text_encoder", dtype=dtype),
                        T5EncoderModel.from_pretrained(root / "text_encoder_2", dtype=dtype))
    # AutoTokenizer makes the classes the checkpoint's tokenizer configs name (FluxPipeline's CLIP and T5 ones)
    return cast("tuple[CLIPTokenizer, T5Tokenizer]", tokenizers), module.to(device).eval()


@torch.no_grad()
def encode_prompts(tokenizers: tuple["CLIPTokenizer", "T5Tokenizer"], text_module: TextModule, prompts: list[str],
                   max_sequence_length: int = MAX_TEXT_TOKENS) -> list[Cond]:
    """One `Cond` per prompt: `encoder_hidden_states` [max_sequence_length, D_t5] and `pooled_projections`
    [D_clip], encoded as one batch, as the pipeline encodes a list."""
    if not 1 <= max_sequence_length <= MAX_TEXT_TOKENS:
        raise ValueError(f"max_sequence_length must be in 1..{MAX_TEXT_TOKENS} (FluxPipeline's limit), "
                         f"got {max_sequence_length}")
    clip_tokenizer, t5_tokenizer = tokenizers
    clip, t5 = text_module.text_encoder, text_module.text_encoder_2
    clip_ids = clip_tokenizer(prompts, padding="max_length", max_length=clip_tokenizer.model_max_length,
                              truncation=True, return_overflowing_tokens=False, return_length=False,
                              return_tensors="pt").input_ids
    pooled = clip(clip_ids.to(clip.device), output_hidden_states=False).pooler_output.to(dtype=clip.dtype)
    t5_ids = t5_tokenizer(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                          return_length=False, return_overflowing_tokens=False, return_tensors="pt").input_ids
    embeds = t5(t5_ids.to(t5.device), output_hidden_states=False)[0].to(dtype=t5.dtype)
    return [{"encoder_hidden_states": e, "pooled_projections": p} for e, p in zip(embeds, pooled)]
