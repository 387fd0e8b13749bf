"""Assembling a train micro-batch from the engine's recorded rollout: only recorded tensors, never re-encoded."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..collate import Cond, collate_cond, cond_mask, sample_cond, warn_if_masked
from ..engine.trajectory import Microgroup, Rollout
from ..models.spec import ModelFamily
from .pairs import Row


@dataclass
class TrainBatch:
    rows: list[Row]
    latents: torch.Tensor  # x_t [R, S, C]
    next_latents: torch.Tensor  # x_{t+1} as stored
    final_latents: torch.Tensor  # the trajectory's clean end x_T (σ = 0) [R, S, C]
    timestep: torch.Tensor  # [R] (or per token [R, S]) the transformer's input, as the pipeline computes it
    sigma: torch.Tensor  # [R] fp32
    sigma_next: torch.Tensor  # [R] fp32
    sigma_1: torch.Tensor  # 0-dim fp32
    old_log_prob: torch.Tensor  # [R] the engine's
    engine_guided: torch.Tensor  # [R, S, C] the engine's guided output (parity reference)
    advantages: torch.Tensor  # [R]
    cond: Cond  # the positive branch's conditioning, collated as the engine collates a microgroup
    negative_cond: Cond | None  # None without CFG
    grid: tuple[int, ...]
    static: dict  # the model's non-tensor inputs, as the engine passed them (e.g. a video's fps)
    expert: str  # the expert that ran these rows' steps in the rollout (as recorded): the one that re-scores them


def _locate(rollout: Rollout) -> dict[int, tuple[Microgroup, int]]:
    return {s: (mg, i) for mg in rollout.microgroups for i, s in enumerate(mg.sample_indices)}


def _expert(where: dict[int, tuple[Microgroup, int]], row: Row) -> str:
    mg, _ = where[row.sample]
    return mg.experts[mg.sde_steps[row.slot]]


def split_by_expert(rollout: Rollout, batches: list[list[Row]], parity: bool = True) -> list[list[Row]]:
    """Each micro-batch whose rows' steps ran on different experts split into one micro-batch per expert (in the
    order the experts first appear, rows in order), since one forward runs one expert. Never under the aligned
    settings (a micro-batch is one microgroup at one step); where it happens the batch shapes differ from the
    rollout's, so in parity mode it warns (condition 4)."""
    where = _locate(rollout)
    out: list[list[Row]] = []
    for rows in batches:
        groups: dict[str, list[Row]] = {}
        for r in rows:
            groups.setdefault(_expert(where, r), []).append(r)
        if len(groups) > 1 and parity:
            warnings.warn(f"condition 4: a train micro-batch's rows ran on the experts {', '.join(groups)}: it is "
                          "split into one forward per expert, whose batch shapes differ from the rollout's "
                          "(docs/patch-group.md)", stacklevel=2)
        out += groups.values()
    return out


def _pad_to(cond: Cond, streams: Mapping[str, str], width: int | None) -> Cond:
    """The whole-window pad (condition 3 broken on purpose, for `--pad-text-to`): each stream zero-padded up to
    `width` tokens, its mask false there."""
    if width is None:
        return cond
    out = dict(cond)
    for key, mask_key in streams.items():
        embeds, mask = cond[key], cond.get(mask_key)
        if embeds is None or width <= embeds.shape[1]:
            continue
        b, length = embeds.shape[:2]
        pad = embeds.new_zeros(b, width - length, *embeds.shape[2:])
        full = torch.ones(b, length, dtype=torch.bool, device=embeds.device) if mask is None else mask
        out[key], out[mask_key] = torch.cat([embeds, pad], 1), torch.cat([full, full.new_zeros(b, width - length)], 1)
    return out


def assemble(rollout: Rollout, rows: list[Row], advantages: torch.Tensor, device: torch.device,
             family: ModelFamily, pad_text_to: int | None = None, parity: bool = True) -> TrainBatch:
    """The micro-batch of `rows` from the rollout's records: its conditioning re-collated from each sample's own
    entries (batch-local padding, as the engine collates), the timestep as `family.train.timestep` makes it."""
    where = _locate(rollout)
    mgs = [where[r.sample] for r in rows]
    experts = {_expert(where, r) for r in rows}
    if len(experts) > 1:
        raise ValueError(f"a micro-batch of rows of several experts ({', '.join(sorted(experts))}): split it first "
                         "(`split_by_expert`)")
    steps = [mg.sde_steps[r.slot] for r, (mg, _) in zip(rows, mgs)]
    dtype = mgs[0][0].latents.dtype
    streams = family.pipeline.text_streams

    def stack(fn):
        return torch.stack([fn(mg, i, t) for (mg, i), t in zip(mgs, steps)]).to(device)

    def cond(field: str) -> Cond | None:
        if getattr(mgs[0][0], field) is None:
            return None
        batch = collate_cond([sample_cond(getattr(mg, field), i, streams) for mg, i in mgs], streams)
        return _pad_to({k: None if v is None else v.to(device) for k, v in batch.items()}, streams, pad_text_to)

    pos, neg = cond("cond"), cond("negative_cond")
    assert pos is not None  # every microgroup has its positive conditioning
    cause = (f"whole-window pad to {pad_text_to} tokens" if pad_text_to is not None
             else "mixed prompt lengths in one micro-batch")
    mask = cond_mask(pos, streams)
    if mask is None and neg is not None:
        mask = cond_mask(neg, streams)
    warn_if_masked(mask, parity=parity, cause=cause)
    return TrainBatch(
        rows=rows,
        latents=stack(lambda mg, i, t: mg.latents[t, i]),
        next_latents=stack(lambda mg, i, t: mg.latents[t + 1, i]),
        final_latents=stack(lambda mg, i, t: mg.latents[-1, i]),
        timestep=family.train.timestep(stack(lambda mg, i, t: mg.timesteps[t]), dtype),
        sigma=stack(lambda mg, i, t: mg.sigmas[t]),
        sigma_next=stack(lambda mg, i, t: mg.sigmas[t + 1]),
        sigma_1=mgs[0][0].sigmas[1].to(device),
        old_log_prob=stack(lambda mg, i, t: mg.log_probs[t, i]),
        engine_guided=torch.stack([mg.guided_outputs[r.slot, i] for r, (mg, i) in zip(rows, mgs)]).to(device),
        advantages=advantages[[r.sample for r in rows]].to(device),
        cond=pos, negative_cond=neg, grid=mgs[0][0].grid, static=dict(mgs[0][0].static), expert=experts.pop())
