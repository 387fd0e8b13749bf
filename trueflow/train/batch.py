"""Assembling a train micro-batch from the engine's recorded rollout: only recorded tensors, never re-encoded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..collate import collate_text, warn_if_masked
from ..engine.trajectory import Microgroup, Rollout, model_timestep
from .pairs import Row


@dataclass
class TrainBatch:
    rows: list[Row]
    latents: torch.Tensor  # x_t [R, S, C]
    next_latents: torch.Tensor  # x_{t+1} as stored
    final_latents: torch.Tensor  # the trajectory's clean end x_T (σ = 0) [R, S, C]
    timestep: torch.Tensor  # [R] the transformer's input, as the pipeline computes it
    sigma: torch.Tensor  # [R] fp32
    sigma_next: torch.Tensor  # [R] fp32
    sigma_1: torch.Tensor  # 0-dim fp32
    old_log_prob: torch.Tensor  # [R] the engine's
    engine_guided: torch.Tensor  # [R, S, C] the engine's guided output (parity reference)
    advantages: torch.Tensor  # [R]
    prompt_embeds: torch.Tensor
    prompt_mask: torch.Tensor | None
    negative_prompt_embeds: torch.Tensor | None
    negative_prompt_mask: torch.Tensor | None
    img_shape: tuple[int, int]


def _locate(rollout: Rollout) -> dict[int, tuple[Microgroup, int]]:
    return {s: (mg, i) for mg in rollout.microgroups for i, s in enumerate(mg.sample_indices)}


def _text(embeds: torch.Tensor, mask: torch.Tensor | None, i: int) -> torch.Tensor:
    """Sample i's own valid tokens (its padding removed), so a batch of other samples pads batch-locally."""
    return embeds[i] if mask is None else embeds[i][mask[i]]


def _pad_to(embeds: torch.Tensor, mask: torch.Tensor | None, width: int | None):
    """The whole-window pad (condition 3 broken on purpose, for `--pad-text-to`): zeros up to `width`."""
    if width is None or width <= embeds.shape[1]:
        return embeds, mask
    b, length, _ = embeds.shape
    pad = embeds.new_zeros(b, width - length, embeds.shape[2])
    full = torch.ones(b, length, dtype=torch.bool, device=embeds.device) if mask is None else mask
    return torch.cat([embeds, pad], 1), torch.cat([full, full.new_zeros(b, width - length)], 1)


def assemble(rollout: Rollout, rows: list[Row], advantages: torch.Tensor, device: torch.device,
             pad_text_to: int | None = None, parity: bool = True,
             timestep: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = model_timestep) -> TrainBatch:
    """`timestep`: schedule t (fp32) -> the transformer's input, the family's `train.timestep`."""
    where = _locate(rollout)
    mgs = [where[r.sample] for r in rows]
    steps = [mg.sde_steps[r.slot] for r, (mg, _) in zip(rows, mgs)]
    dtype = mgs[0][0].latents.dtype

    def stack(fn):
        return torch.stack([fn(mg, i, t) for (mg, i), t in zip(mgs, steps)]).to(device)

    def text(field: str):
        if getattr(mgs[0][0], field) is None:
            return None, None
        embeds, mask = collate_text([_text(getattr(mg, field), getattr(mg, field.replace("embeds", "mask")), i)
                                     for mg, i in mgs])
        return _pad_to(embeds.to(device), None if mask is None else mask.to(device), pad_text_to)

    pos, pos_mask = text("prompt_embeds")
    neg, neg_mask = text("negative_prompt_embeds")
    cause = (f"whole-window pad to {pad_text_to} tokens" if pad_text_to is not None
             else "mixed prompt lengths in one micro-batch")
    warn_if_masked(pos_mask if pos_mask is not None else neg_mask, parity=parity, cause=cause)
    return TrainBatch(
        rows=rows,
        latents=stack(lambda mg, i, t: mg.latents[t, i]),
        next_latents=stack(lambda mg, i, t: mg.latents[t + 1, i]),
        final_latents=stack(lambda mg, i, t: mg.latents[-1, i]),
        timestep=timestep(stack(lambda mg, i, t: mg.timesteps[t]), dtype),
        sigma=stack(lambda mg, i, t: mg.sigmas[t]),
        sigma_next=stack(lambda mg, i, t: mg.sigmas[t + 1]),
        sigma_1=mgs[0][0].sigmas[1].to(device),
        old_log_prob=stack(lambda mg, i, t: mg.log_probs[t, i]),
        engine_guided=torch.stack([mg.guided_outputs[r.slot, i] for r, (mg, i) in zip(rows, mgs)]).to(device),
        advantages=advantages[[r.sample for r in rows]].to(device),
        prompt_embeds=pos, prompt_mask=pos_mask, negative_prompt_embeds=neg, negative_prompt_mask=neg_mask,
        img_shape=mgs[0][0].img_shape)
