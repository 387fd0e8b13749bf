"""Prompt encoding, bitwise as `StableDiffusion3Pipeline.encode_prompt` computes it (text encoding is not the DiT: the
engine runs transformers' own CLIP and T5 modules here).

What the pipeline does (diffusers 0.42.1, `encode_prompt`, `_get_clip_prompt_embeds`, `_get_t5_prompt_embeds`):
- each CLIP (`CLIPTextModelWithProjection`: L, then G) gets its tokenizer's ids padded to exactly
  `tokenizer.model_max_length` (77, the FIRST tokenizer's for both) with truncation and no attention mask; the
  embeddings are the penultimate hidden state (`hidden_states[-2]`, no clip skip) cast to the first CLIP's dtype, the
  pooled output its projected `text_embeds` (`[0]`) as it comes;
- T5 (`T5EncoderModel`) gets ids padded to exactly `max_sequence_length` (truncation, eos added) and no mask; its
  last hidden state is cast to T5's dtype;
- the two CLIP embeddings are concatenated on the channel axis, zero-padded to T5's width, and put BEFORE T5's
  tokens: `[77 + max_sequence_length, joint_attention_dim]`; the pooled outputs are concatenated, L then G.
Every prompt therefore has the same length and no mask: the conditioning is stacked, not padded (no text stream).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ...collate import Cond

if TYPE_CHECKING:  # the classes load transformers' model code; callers pass built objects
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

MAX_TEXT_TOKENS = 512  # StableDiffusion3Pipeline.check_inputs: max_sequence_length cannot be greater than 512


class TextModule(nn.Module):
    """The pipeline's three text encoders: `text_encoder` (CLIP-L), `text_encoder_2` (CLIP-G), `text_encoder_3`
    (T5-XXL)."""

    def __init__(self, text_encoder: CLIPTextModelWithProjection, text_encoder_2: CLIPTextModelWithProjection,
                 text_encoder_3: T5EncoderModel):
        super().__init__()
        self.text_encoder, self.text_encoder_2, self.text_encoder_3 = text_encoder, text_encoder_2, text_encoder_3


def load_text(root: str | Path, device: torch.device | str, dtype: torch.dtype) -> tuple[tuple[Any, Any, Any],
                                                                                         TextModule]:
    """The checkpoint's three tokenizers, and its three text encoders in `dtype` on `device` (eval mode), loaded as
    the pipeline's `from_pretrained(dtype=...)` loads them."""
    # transformers' T5TokenizerFast (what the pipeline names) is T5Tokenizer (one tokenizers-backed class)
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5Tokenizer

    root = Path(root)
    tokenizers = (CLIPTokenizer.from_pretrained(root / "tokenizer"),
                  CLIPTokenizer.from_pretrained(root / "tokenizer_2"),
                  T5Tokenizer.from_pretrained(root / "tokenizer_3"))
    encoders = TextModule(CLIPTextModelWithProjection.from_pretrained(root / "text_encoder", dtype=dtype),
                          CLIPTextModelWithProjection.from_pretrained(root / "text_encoder_2", dtype=dtype),
                          T5EncoderModel.from_pretrained(root / "text_encoder_3", dtype=dtype))
    return tokenizers, encoders.to(device).eval()


def _clip(tokenizer, text_encoder: nn.Module, prompts: list[str], max_length: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`_get_clip_prompt_embeds`: (penultimate hidden state cast to `dtype`, projected pooled output)."""
    ids = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                    return_tensors="pt").input_ids
    out = text_encoder(ids.to(text_encoder.device), output_hidden_states=True)
    return out.hidden_states[-2].to(dtype=dtype), out[0]


@torch.no_grad()
def encode_prompts(tokenizers: tuple[Any, Any, Any], text: TextModule, prompts: list[str],
                   max_sequence_length: int = 256) -> list[Cond]:
    """One `Cond` per prompt: `encoder_hidden_states` `[77 + max_sequence_length, joint width]` and
    `pooled_projections` `[pooled width]`, the prompts encoded as one batch, as `encode_prompt` encodes a list."""
    if not 1 <= max_sequence_length <= MAX_TEXT_TOKENS:
        raise ValueError(f"max_sequence_length must be in 1..{MAX_TEXT_TOKENS} (StableDiffusion3Pipeline's T5 "
                         f"window), got {max_sequence_length}")
    clip_length = tokenizers[0].model_max_length  # the pipeline's tokenizer_max_length, used for both CLIPs
    clip_dtype = text.text_encoder.dtype
    l_embeds, l_pooled = _clip(tokenizers[0], text.text_encoder, prompts, clip_length, clip_dtype)
    g_embeds, g_pooled = _clip(tokenizers[1], text.text_encoder_2, prompts, clip_length, clip_dtype)
    t5 = text.text_encoder_3
    ids = tokenizers[2](prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                        add_special_tokens=True, return_tensors="pt").input_ids
    t5_embeds = t5(ids.to(t5.device))[0].to(dtype=t5.dtype)
    clip_embeds = torch.cat([l_embeds, g_embeds], dim=-1)
    clip_embeds = F.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))
    embeds = torch.cat([clip_embeds, t5_embeds], dim=-2)
    pooled = torch.cat([l_pooled, g_pooled], dim=-1)
    return [{"encoder_hidden_states": e, "pooled_projections": p} for e, p in zip(embeds, pooled)]
