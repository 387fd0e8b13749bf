"""Prompt encoding, bitwise as `LTX2Pipeline.encode_prompt` and its connectors call compute it (text encoding is
not the DiT: the engine runs diffusers'/transformers' own modules here).

What the pipeline does (diffusers 0.42.1, `_get_gemma_prompt_embeds` then `self.connectors`):
- prompts are stripped, tokenized with LEFT padding to exactly `max_sequence_length` tokens (`padding="max_length"`,
  truncation, bos added), so every prompt of a batch has the same length, the whole window;
- Gemma-3 runs on the padded batch; all its hidden states (embeddings + each layer) are stacked on a last axis and
  flattened to `[B, L, hidden x (layers + 1)]`, cast to the text encoder's dtype;
- the connectors (LTX-2.3: per-token RMS norm, the padding zeroed, per-modality projections to the video and audio
  widths, one 1-D transformer per stream) move each prompt's valid tokens to the front and fill the rest with
  learnable registers, so after them EVERY position is valid: the mask they return is all ones (int64 `[B, L]`).
  `L` must be a multiple of the connectors' register count (128 in LTX-2.3).

What the transformer receives, per stream: `encoder_hidden_states` `[B, L, video width]` and
`audio_encoder_hidden_states` `[B, L, audio width]` in the connectors' dtype, and the all-ones mask as BOTH
`encoder_attention_mask` and `audio_encoder_attention_mask`. The transformer still turns that mask into an additive
bias, `(1 - mask.to(dtype)) * -10000.0` = -0.0 everywhere, `[B, 1, L]`, repeated over heads by
`prepare_attention_mask`, and hands it to the attention backend of every text cross-attention. So the cross
attentions always run with a mask: `_native_flash` raises on any mask, and SDPA dispatches a masked call to its
masked kernels (on CUDA the flash kernel takes no mask; on the CPU the -0.0 bias gives the mask-less bits, checked).
Here the collate turns the all-true mask into `None` (every prompt is `L` long);
`trueflow.models.ltx2.train.train_forward` passes the all-ones mask back, as the pipeline does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...collate import Cond

if TYPE_CHECKING:  # the classes load transformers' and diffusers' model code; callers pass built objects
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from transformers import Gemma3ForConditionalGeneration, GemmaTokenizer

# Token stream -> its mask key, named as `LTX2VideoTransformer3DModel.forward`'s keyword arguments.
TEXT_STREAMS: dict[str, str] = {
    "encoder_hidden_states": "encoder_attention_mask",
    "audio_encoder_hidden_states": "audio_encoder_attention_mask",
}

MAX_TEXT_TOKENS = 1024  # LTX2Pipeline's default max_sequence_length (Gemma-3's window is far longer)


class TextModule(nn.Module):
    """Gemma-3 and the LTX-2 connectors, the two modules `encode_prompts` runs."""

    def __init__(self, text_encoder: Gemma3ForConditionalGeneration, connectors: LTX2TextConnectors):
        super().__init__()
        self.text_encoder = text_encoder
        self.connectors = connectors


def load_text(root: str | Path, device: torch.device | str, dtype: torch.dtype) -> tuple["GemmaTokenizer", TextModule]:
    """The checkpoint's tokenizer, and its text encoder and connectors in `dtype` on `device` (eval mode)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import Gemma3ForConditionalGeneration, GemmaTokenizer

    root = Path(root)
    tokenizer = GemmaTokenizer.from_pretrained(root / "tokenizer")
    text_encoder = Gemma3ForConditionalGeneration.from_pretrained(root / "text_encoder", dtype=dtype)
    connectors = LTX2TextConnectors.from_pretrained(root / "connectors", dtype=dtype)
    return tokenizer, TextModule(text_encoder, connectors).to(device).eval()


@torch.no_grad()
def encode_prompts(tokenizer: "GemmaTokenizer", text_module: TextModule, prompts: list[str],
                   max_sequence_length: int = MAX_TEXT_TOKENS) -> list[Cond]:
    """One `Cond` per prompt: `encoder_hidden_states` `[L, video width]` and `audio_encoder_hidden_states`
    `[L, audio width]`, L = max_sequence_length, every token valid (no mask entry: see the module docstring).

    The prompts are encoded as one batch, as the pipeline encodes a list (unguided; with guidance it encodes the
    negatives in their own batch, then runs the connectors on [negatives, prompts])."""
    text_encoder, connectors = text_module.text_encoder, text_module.connectors
    registers = connectors.config["video_connector_num_learnable_registers"]
    if max_sequence_length < 1 or (registers and max_sequence_length % registers):
        raise ValueError(f"max_sequence_length must be a positive multiple of the connectors' {registers} learnable "
                         f"registers, got {max_sequence_length}")
    # The pipeline sets these on its tokenizer before every call.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokens = tokenizer([p.strip() for p in prompts], padding="max_length", max_length=max_sequence_length,
                       truncation=True, add_special_tokens=True, return_tensors="pt")
    ids, mask = tokens.input_ids.to(text_encoder.device), tokens.attention_mask.to(text_encoder.device)
    hidden = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    embeds = torch.stack(hidden, dim=-1).flatten(2, 3).to(dtype=text_encoder.dtype)
    video, audio, connector_mask = connectors(embeds, mask, padding_side=tokenizer.padding_side)
    if not bool(connector_mask.all()):  # the registers fill every padded position; anything else is a new diffusers
        raise AssertionError("LTX-2 connectors returned a partial mask; this family assumes an all-ones one")
    return [{"encoder_hidden_states": v, "audio_encoder_hidden_states": a} for v, a in zip(video, audio)]
