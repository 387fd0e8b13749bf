"""Prompt encoding, bitwise as `QwenImagePipeline.encode_prompt` (its `_get_qwen_prompt_embeds`) does it.

The text encoder is transformers' `Qwen2_5_VLForConditionalGeneration` with the checkpoint's tokenizer,
called directly. The trainer never re-encodes: it re-scores with the embeddings the engine recorded
(parity condition 7 of docs/patch-group.md), because a differently padded text-encoder batch changes bits first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the classes load transformers' model code; the engine passes built objects
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

# `QwenImagePipeline.__init__` hard-codes the chat template and how many of its leading tokens to drop; no checkpoint
# file holds them (tests check both equal the pipeline's own attributes; the tiny-checkpoint writer imports them).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_START_IDX = 34

# `QwenImagePipeline.tokenizer_max_length`: the pipeline truncates the *templated* text at this many tokens
# plus the dropped prefix, and only later cuts the embeddings to `max_sequence_length`. We truncate at the
# same place (not at max_sequence_length + 34) so the text encoder runs on the pipeline's very sequence.
TOKENIZER_MAX_LENGTH = 1024


@torch.no_grad()
def encode_prompts(
    tokenizer: "Qwen2Tokenizer",
    text_encoder: "Qwen2_5_VLForConditionalGeneration",
    prompts: list[str],
    max_sequence_length: int = 512,
) -> list[torch.Tensor]:
    """Each prompt's valid text embeddings `[L_i, D]`, in the text encoder's dtype.

    The prompts are encoded as one padded batch, as the pipeline encodes a list: chat template, tokenizer
    padding to the batch's longest (truncated at 1024 + 34 tokens), the last hidden state; each prompt keeps
    its valid tokens minus the template's first 34, cut to `max_sequence_length`. `collate_text` re-pads
    them batch-locally with zeros, which gives the pipeline's `(prompt_embeds, prompt_embeds_mask)` bitwise.
    """
    if not 1 <= max_sequence_length <= TOKENIZER_MAX_LENGTH:
        raise ValueError(f"max_sequence_length must be in 1..{TOKENIZER_MAX_LENGTH} (the pipeline's limit), "
                         f"got {max_sequence_length}")
    tokens = tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts],
                       max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_START_IDX, padding=True, truncation=True,
                       return_tensors="pt").to(text_encoder.device)
    hidden = text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                          output_hidden_states=True).hidden_states[-1]
    valid = tokens.attention_mask.bool()
    per_prompt = hidden[valid].split(valid.sum(dim=1).tolist(), dim=0)
    return [e[PROMPT_TEMPLATE_START_IDX:][:max_sequence_length].to(text_encoder.dtype) for e in per_prompt]
