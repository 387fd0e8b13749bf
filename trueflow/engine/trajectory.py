"""What a rollout returns: per-microgroup trajectories, recorded exactly as the engine ran them.

The trainer re-scores from these records and nothing else (parity conditions 7 and 8,
docs/patch-group.md): the same prompt
embeddings and masks, the same batch (one microgroup), the same latents and timesteps, in the same order
(`trueflow.train.batch.assemble` cuts its micro-batches from them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import SamplingParams


def model_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' transformer timestep input for schedule timesteps `t` (fp32, 0..1000), as `QwenImagePipeline`
    computes it: `t.to(latent dtype) / 1000`. In bf16 that rounds twice (t, then the quotient), which differs
    from rounding the fp32 `t / 1000` once in about a quarter of the timesteps of a 10-step schedule. (The
    engine model takes the fp32 `t` itself; its qwen_image patch group rounds it the same way inside.)"""
    return t.to(dtype) / 1000


@dataclass
class StepRecord:
    """Debug data of one denoising step (`record_snapshot=True`); fp32 unless noted."""

    positive_output: torch.Tensor  # [B, S, C] latent dtype: the positive branch's model output
    negative_output: torch.Tensor | None  # [B, S, C] latent dtype; None without CFG
    guided_output: torch.Tensor  # [B, S, C] latent dtype: what the sampler stepped with
    mean: torch.Tensor | None = None  # [B, S, C] the stochastic transition's mean; None for ODE steps
    std: torch.Tensor | None = None  # 0-dim, the transition's standard deviation
    noise: torch.Tensor | None = None  # [B, S, C] the standard normal draw


@dataclass
class Microgroup:
    """One prompt's samples that ran as one batch: the unit the trainer must re-score as one micro-batch."""

    prompt_index: int
    sample_indices: list[int]  # global, prompt-major: sample k of prompt p is p * n_per_prompt + k
    img_shape: tuple[int, int]  # packed token grid (rows, columns)
    latents: torch.Tensor  # [T + 1, B, S, C] latent dtype, x_0 (noise) .. x_T, as stored
    sigmas: torch.Tensor  # [T + 1] fp32
    timesteps: torch.Tensor  # [T] fp32 schedule timesteps (0..1000), the engine model's input; diffusers': model_timestep()
    log_probs: torch.Tensor  # [T, B] fp32, 0 at ODE steps
    sde_steps: list[int]  # the stochastic (trained) steps, sorted
    guided_outputs: torch.Tensor  # [len(sde_steps), B, S, C] latent dtype, the guided output at each SDE step
    prompt_embeds: torch.Tensor  # [B, L, D] as the positive branch got them
    prompt_mask: torch.Tensor | None  # bool [B, L]; None = all tokens valid (always, for one prompt)
    negative_prompt_embeds: torch.Tensor | None  # [B, L', D]; None without CFG
    negative_prompt_mask: torch.Tensor | None
    records: list[StepRecord] | None = None  # one per step, with record_snapshot=True


@dataclass
class Rollout:
    prompts: list[str]
    n_per_prompt: int
    params: SamplingParams
    seed: int
    microgroups: list[Microgroup]  # prompt-major, then sample order: the order to train in
    images: torch.Tensor | None  # uint8 [P * n, H, W, 3] prompt-major; None with decode=False
    engine: dict  # checkpoint, patch group, patches applied, dtype, device (and weights checksum in snapshots)
