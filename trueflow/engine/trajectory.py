"""What a rollout returns: per-microgroup trajectories, recorded exactly as the engine ran them.

The trainer re-scores from these records and nothing else (parity conditions 7 and 8,
docs/patch-group.md): the same conditioning (prompt embeddings and masks, as named tensors), the same batch (one
microgroup), the same latents and timesteps, in the same order (`trueflow.train.batch.assemble` cuts its
micro-batches from them). Nothing in a record is specific to one family: the token grid may have any rank (frames,
rows, cols), the timesteps may be per token, and the conditioning holds whatever streams the family's model takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..collate import Cond

if TYPE_CHECKING:
    from .engine import SamplingParams


@dataclass
class StepRecord:
    """Debug data of one denoising step (`record_snapshot=True`); fp32 unless noted."""

    positive_output: torch.Tensor  # [B, S, C] model dtype: the positive branch's model output
    negative_output: torch.Tensor | None  # [B, S, C] model dtype; None without CFG
    # [B, S, C]: what the sampler stepped with (CFG, then the family's `model_output`: LTX-2.3's is fp32)
    guided_output: torch.Tensor
    mean: torch.Tensor | None = None  # [B, S, C] the stochastic transition's mean; None for ODE steps
    std: torch.Tensor | None = None  # 0-dim, the transition's standard deviation
    noise: torch.Tensor | None = None  # [B, S, C] the standard normal draw


@dataclass
class Microgroup:
    """One prompt's samples that ran as one batch: the unit the trainer must re-score as one micro-batch."""

    prompt_index: int
    sample_indices: list[int]  # global, prompt-major: sample k of prompt p is p * n_per_prompt + k
    grid: tuple[int, ...]  # one sample's token grid: (rows, cols) for images, (frames, rows, cols) for video
    latents: torch.Tensor  # [T + 1, B, S, C] latent dtype, x_0 (noise) .. x_T, as stored
    sigmas: torch.Tensor  # [T + 1] fp32
    # [T] (or per token [T, S]) fp32 schedule timesteps (0..1000), the engine model's input; the diffusers
    # model's is the family's `train.timestep` of it
    timesteps: torch.Tensor
    log_probs: torch.Tensor  # [T, B] fp32, 0 at ODE steps
    sde_steps: list[int]  # the stochastic (trained) steps, sorted
    guided_outputs: torch.Tensor  # [len(sde_steps), B, S, C] latent dtype, the guided output at each SDE step
    # The positive branch's conditioning as the model got it, batch-first (e.g. `encoder_hidden_states` [B, L, D]
    # and `encoder_hidden_states_mask`, None = all tokens valid: always, for one prompt)
    cond: Cond
    negative_cond: Cond | None  # the negative branch's; None without CFG
    # [T] the expert (its pipeline component, e.g. "transformer_2") that ran each step: what the trainer re-scores
    # each step with, never re-derived from the timesteps
    experts: list[str]
    static: dict = field(default_factory=dict)  # the model's non-tensor inputs (e.g. a video's fps), both branches
    records: list[StepRecord] | None = None  # one per step, with record_snapshot=True


@dataclass
class Rollout:
    prompts: list[str]
    n_per_prompt: int
    params: SamplingParams
    seed: int
    microgroups: list[Microgroup]  # prompt-major, then sample order: the order to train in
    images: torch.Tensor | None  # uint8 [P * n, H, W, 3] (video: [P * n, F, H, W, 3]) prompt-major; None: decode=False
    engine: dict  # checkpoint, patch group, patches applied, dtype, device (and weights checksum in snapshots)
    first_prompt: int = 0  # the global index of prompts[0] (a data-parallel share): what the random streams follow
    rewards: torch.Tensor | None = None  # float32 [P * n], NaN where dropped; set by a scored placement
    dropped: list[int] | None = None  # samples whose prompt group the reward dropped
    times: dict[str, float] = field(default_factory=dict)  # seconds: "rollout" (the engine's), "reward"
