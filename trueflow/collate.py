"""The conditioning collate rule shared by the rollout engine and the trainer (parity conditions 2 and 3,
docs/patch-group.md).

A branch's conditioning (`Cond`) is the model's inputs besides the latents and the timestep, named as the family's
diffusers transformer names its keyword arguments. A family declares which of them are variable-length token
streams (`PipelineSide.text_streams`: stream key -> mask key); every other entry has one shape per sample and is
stacked. Both sides pad a batch's streams the same way, so a train micro-batch equal to a rollout microgroup has the
very widths and masks the engine ran with:
- padding is batch-local: to the longest prompt *in the batch*, never to a fixed window (condition 3);
- an all-true mask becomes `None`, so both sides take the same mask-less attention kernel (condition 2).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import cast

import torch

Cond = dict[str, torch.Tensor | None]


def collate_text(
    embeds: list[torch.Tensor], masks: list[torch.Tensor | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack per-sample text embeddings `[L_i, D]` into `[B, L_max, D]`, zero-padded at the end.

    `masks[i]` is sample i's bool `[L_i]` mask (True = a valid token), or None when all its tokens are valid
    (the default for every sample). Padding positions are False. Returns `(padded, mask)` with mask bool
    `[B, L_max]`, or None when every position is valid. The zeros and the bool mask are what
    `QwenImagePipeline` pads with, so a collated batch is bitwise the pipeline's.
    """
    if not embeds:
        raise ValueError("collate_text needs at least one sample")
    if masks is not None and len(masks) != len(embeds):
        raise ValueError(f"collate_text got {len(embeds)} embeddings but {len(masks)} masks")
    width = max(e.shape[0] for e in embeds)
    padded = torch.stack([torch.cat([e, e.new_zeros(width - e.shape[0], e.shape[1])]) for e in embeds])
    mask = torch.zeros(padded.shape[:2], dtype=torch.bool, device=padded.device)
    for i, e in enumerate(embeds):
        own = None if masks is None else masks[i]
        mask[i, : e.shape[0]] = True if own is None else own.bool()
    return padded, None if bool(mask.all()) else mask


def collate_cond(samples: list[Cond], streams: Mapping[str, str]) -> Cond:
    """A batch's conditioning from per-sample entries (each without the batch dim): each stream in `streams`
    collated with its mask (`collate_text`; a sample's own mask entry may be absent or None), every other entry
    stacked (None stays None)."""
    if not samples:
        raise ValueError("collate_cond needs at least one sample")
    masks = set(streams.values())
    out: Cond = {}
    for key in samples[0]:
        if key in masks:
            continue  # collated with its stream
        if key in streams:
            # a text stream's entry is a tensor in every sample (only its mask may be None)
            out[key], out[streams[key]] = collate_text(cast(list[torch.Tensor], [s[key] for s in samples]),
                                                       [s.get(streams[key]) for s in samples])
        else:
            values = [s[key] for s in samples]
            # an entry is None in every sample or in none (`Cond`)
            out[key] = None if values[0] is None else torch.stack(cast(list[torch.Tensor], values))
    return out


def sample_cond(cond: Cond, i: int, streams: Mapping[str, str]) -> Cond:
    """Sample i's own entries of a collated batch, the inverse of `collate_cond`: each stream cut to the sample's
    valid tokens (its padding removed, so a batch of other samples pads batch-locally), the rest indexed."""
    masks = set(streams.values())
    out: Cond = {}
    for key, value in cond.items():
        if key in masks:
            continue
        if key in streams:
            mask = cond.get(streams[key])
            assert value is not None  # a text stream is a tensor
            out[key] = value[i] if mask is None else value[i][mask[i]]
        else:
            out[key] = None if value is None else value[i]
    return out


def cond_mask(cond: Cond, streams: Mapping[str, str]) -> torch.Tensor | None:
    """The first stream mask of a batch that is not all true (None: every stream of every sample is whole)."""
    return next((cond[m] for m in streams.values() if cond.get(m) is not None), None)


def warn_if_masked(mask: torch.Tensor | None, parity: bool, cause: str) -> None:
    """In parity mode, warn that a non-trivial text mask makes parity not bitwise (parity condition 2,
    docs/patch-group.md).

    A mask takes the train side off its pinned `_native_flash` kernel (which refuses masks) onto a masked one,
    so its outputs can no longer equal the rollout's bit for bit. `cause` names why the batch has a mask,
    e.g. "mixed prompt lengths in one batch".
    """
    if parity and mask is not None:
        warnings.warn(f"text mask is not all true ({cause}): attention runs a masked kernel, so parity is not "
                      "bitwise (parity condition 2, docs/patch-group.md). Keep one prompt per batch (micro-batch == "
                      "rollout "
                      "microgroup, DP split contiguous) for bitwise parity.", stacklevel=2)
