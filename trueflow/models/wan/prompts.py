"""Prompt encoding, bitwise as `WanPipeline.encode_prompt` computes it (`_get_t5_prompt_embeds`, diffusers 0.42.1):
the engine runs transformers' own UMT5 encoder here.

What the pipeline does: each prompt is cleaned (`prompt_clean`: ftfy where installed, HTML unescaped twice,
whitespace collapsed), tokenized to exactly `max_sequence_length` tokens (`padding="max_length"`, truncation, eos
added, default 512), run through `UMT5EncoderModel` with its attention mask, cast to the text encoder's dtype; then
each prompt is cut to its own valid tokens and zero-padded back to `max_sequence_length` — the padded positions hold
zeros, not the encoder's outputs there. The transformer gets no text mask at all: the zeros are attended to as
tokens. So every prompt's conditioning is `[max_sequence_length, text_dim]`, of one width whatever its length, and the
collate stacks it (no stream to pad, no mask: parity conditions 2 and 3 hold for mixed prompts too).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...collate import Cond

if TYPE_CHECKING:  # the classes load transformers' model code; callers pass built objects
    from transformers import PreTrainedTokenizerBase, UMT5EncoderModel

MAX_TEXT_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length default (UMT5's window in Wan)
TEXT_STREAMS: dict[str, str] = {}  # no variable-length stream: every prompt is padded to max_sequence_length


def load_text(root: str | Path, device: torch.device | str, dtype: torch.dtype
              ) -> tuple["PreTrainedTokenizerBase", "UMT5EncoderModel"]:
    """The checkpoint's tokenizer and its UMT5 encoder in `dtype` on `device` (eval mode), loaded as the pipeline
    loads them."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    root = Path(root)
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    text_encoder = UMT5EncoderModel.from_pretrained(root / "text_encoder", dtype=dtype)
    return tokenizer, text_encoder.to(device).eval()  # type: ignore[arg-type]  # transformers' `@wraps` .to, typed unbound by typeshed


@torch.no_grad()
def encode_prompts(tokenizer: "PreTrainedTokenizerBase", text_encoder: "UMT5EncoderModel", prompts: list[str],
                   max_sequence_length: int = MAX_TEXT_TOKENS) -> list[Cond]:
    """One `Cond` per prompt: `encoder_hidden_states` `[max_sequence_length, d_model]`, the prompt's valid tokens
    followed by zeros. The prompts are encoded as one batch, as the pipeline encodes a list."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    tokens = tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=max_sequence_length,
                       truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    ids, mask = tokens.input_ids, tokens.attention_mask
    seq_lens = mask.gt(0).sum(dim=1).long()
    device = text_encoder.device
    embeds = text_encoder(ids.to(device), mask.to(device)).last_hidden_state.to(dtype=text_encoder.dtype)
    return [{"encoder_hidden_states": torch.cat([u[:v], u.new_zeros(max_sequence_length - v, u.size(1))])}
            for u, v in zip(embeds, seq_lens.tolist())]
