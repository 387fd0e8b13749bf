"""The in-process rollout engine: prompts -> microgroups -> denoise loop -> recorded trajectories (+ images).

A prompt's `n` samples run in microgroups of `rollout_microgroup_size`, in order. Each microgroup is one batch
through the whole loop: two separate branch forwards per step (positive, then negative), true CFG, then an ODE
step or, inside the SDE window, a stochastic step with its log-prob. Randomness is per sample: sample k of
prompt p owns one CPU generator (its initial noise, then its step noise), so a sample's noise does not depend
on the batch it runs in; the SDE window is drawn once per microgroup from its own generator.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from ..collate import collate_text
from ..layers.linear import Linear
from ..loading import CheckpointError
from ..models.qwen_image.weights import load_weights
from ..sync.checksum import tensors_checksum
from . import weights
from .cuda_graph import GraphedForward
from .guidance import true_cfg
from .prompts import TOKENIZER_MAX_LENGTH, encode_prompts
from .samplers import cps_step, draw_sde_window, ode_step, sample_noise, sde_step
from .schedule import qwen_image_schedule
from .trajectory import Microgroup, Rollout, StepRecord
from .vae import PIXELS_PER_TOKEN, VaeDecoder, latent_grid, pack_latents

SAMPLERS = ("ode", "sde", "cps")


class RolloutCancelled(Exception):
    """A rollout stopped between denoising steps because its `should_stop` said so; nothing is returned."""


@dataclass
class SamplingParams:
    steps: int = 10
    sampler: str = "sde"  # "ode" | "sde" | "cps"
    noise_level: float = 0.7  # a, of the SDE and CPS steps
    cfg_scale: float = 4.0  # true CFG when > 1 (as the pipeline: 1 runs the positive branch alone)
    negative_prompt: str = " "
    num_sde_steps: int | None = None  # stochastic steps per trajectory; None: every step (sde/cps)
    sde_window: tuple[int, int] | None = None  # half-open step range the window lies in; None: all steps
    height: int = 64
    width: int = 64
    max_sequence_length: int = 512
    rollout_microgroup_size: int | None = None  # None: a prompt's n samples in one microgroup

    def __post_init__(self) -> None:
        if self.sde_window is not None:
            self.sde_window = tuple(self.sde_window)  # e.g. a list read back from JSON
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        for name in ("noise_level", "cfg_scale"):  # NaN slips through every comparison below
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose one of {', '.join(SAMPLERS)}")
        if self.sampler != "ode" and not self.noise_level > 0:
            raise ValueError(f"the {self.sampler} sampler needs noise_level > 0, got {self.noise_level}; "
                             f"use sampler='ode' for deterministic sampling")
        if self.cfg_scale < 1:
            raise ValueError(f"cfg_scale must be >= 1 (1 turns guidance off), got {self.cfg_scale}")
        if self.sampler == "ode" and (self.num_sde_steps is not None or self.sde_window is not None):
            raise ValueError("num_sde_steps/sde_window need a stochastic sampler: set sampler='sde' or 'cps', "
                             "or leave them unset for ODE sampling")
        if self.num_sde_steps is not None and not 1 <= self.num_sde_steps <= self.steps:
            raise ValueError(f"num_sde_steps must be in 1..steps={self.steps} (None: every step), "
                             f"got {self.num_sde_steps}")
        if self.sde_window is not None:
            if self.num_sde_steps is None:
                raise ValueError("sde_window needs num_sde_steps (how many steps of the window are stochastic)")
            lo, hi = self.sde_window
            if not (0 <= lo < hi <= self.steps and hi - lo >= self.num_sde_steps):
                raise ValueError(f"sde_window {self.sde_window} must satisfy 0 <= lo < hi <= steps={self.steps} "
                                 f"and hold num_sde_steps={self.num_sde_steps} steps")
        for name in ("height", "width"):
            v = getattr(self, name)
            if v < PIXELS_PER_TOKEN or v % PIXELS_PER_TOKEN:
                raise ValueError(f"{name} must be a positive multiple of {PIXELS_PER_TOKEN} pixels "
                                 f"(VAE factor 8 x patch 2), got {v}")
        if not 1 <= self.max_sequence_length <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"max_sequence_length must be in 1..{TOKENIZER_MAX_LENGTH}, got {self.max_sequence_length}")
        if self.rollout_microgroup_size is not None and self.rollout_microgroup_size < 1:
            raise ValueError(f"rollout_microgroup_size must be >= 1 (None: all samples of a prompt), "
                             f"got {self.rollout_microgroup_size}")

    @property
    def cfg(self) -> bool:
        return self.cfg_scale > 1


# Random streams, kept apart: the noise of one sample, the SDE window of one microgroup.
_NOISE_STREAM, _WINDOW_STREAM = 0, 1


def derive_seed(seed: int, *path: int) -> int:
    """A 63-bit seed for the random stream at `path` under `seed` (blake2b of the signed 64-bit integers): the
    same on every platform, and unrelated for neighbouring paths, unlike `seed + k`."""
    digest = hashlib.blake2b(struct.pack(f"<{1 + len(path)}q", seed, *path), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Engine:
    """Loads a Qwen-Image pipeline folder: the engine transformer (with a rollout patch group), the text
    encoder and tokenizer, the VAE and the scheduler config. On CUDA the transformer's forwards replay CUDA graphs
    (one per shape, bitwise equal to eager; `cuda_graphs=False` runs eagerly)."""

    def __init__(self, checkpoint: str | Path, patch_group: str = "none", disabled_patches: tuple[str, ...] = (),
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, cuda_graphs: bool = True):
        root = Path(checkpoint)
        for sub in ("tokenizer", "text_encoder", "vae", "scheduler"):
            if not (root / sub).is_dir():
                raise CheckpointError(f"{root}: no {sub}/ folder; the engine needs a whole diffusers pipeline folder "
                                      f"(`trueflow init-checkpoint --family qwen_image --size tiny --out DIR` writes one)")
        self.checkpoint, self.device, self.dtype = str(root), torch.device(device), dtype
        self.patch_group, self.disabled_patches = patch_group, tuple(disabled_patches)
        self.transformer = weights.load_engine_transformer(root, self.device, dtype, patch_group, disabled_patches)
        self.forward = GraphedForward(self.transformer, enabled=cuda_graphs and self.device.type == "cuda")
        self.tokenizer = Qwen2Tokenizer.from_pretrained(root / "tokenizer")
        self.text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            root / "text_encoder", dtype=dtype).to(self.device).eval()
        self.vae = VaeDecoder(root, self.device, dtype)
        self.scheduler_config = json.loads((root / "scheduler" / "scheduler_config.json").read_text())

    # -- weights -------------------------------------------------------------------------------------------
    def update_lora(self, peft_state_dict: dict[str, torch.Tensor], scale: float, merge_mode: str | None = None) -> None:
        """Replace the LoRA (PEFT-format tensors); merged or not as `engine.weights.resolve_lora_merge` decides."""
        weights.update_lora(self.transformer, peft_state_dict, scale, merge_mode)

    def lora_checksum(self) -> str:
        """Checksum of the installed LoRA read back from the engine's layers (`sync.checksum`); equal to the
        trainer's checksum of what it sent once an update is in place."""
        return tensors_checksum(weights.lora_state(self.transformer))

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace all transformer weights (diffusers names); any LoRA is dropped."""
        load_weights(self.transformer, state_dict)

    def weights_checksum(self) -> str:
        """`sync.checksum.tensors_checksum` of every transformer parameter (engine names) and the installed LoRA
        (diffusers names, merged or not; its scale in the hashed text): a few integer sums per tensor on the
        device, hashed on the CPU, so it is cheap on GPU and identical across devices and runs."""
        tensors = dict(self.transformer.named_parameters())
        tensors.update({f"lora.{k}": v for k, v in weights.lora_state(self.transformer).items()})
        scales = sorted({a.scale for m in self.transformer.modules() if isinstance(m, Linear) for a in m.adapters if a})
        return tensors_checksum(tensors, extra=f"lora_scales={scales}")

    # -- rollout -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, prompts: list[str], n_per_prompt: int, params: SamplingParams, seed: int, decode: bool = True,
                record_snapshot: bool = False, progress: bool = False,
                should_stop: Callable[[], bool] | None = None) -> Rollout:
        """`n_per_prompt` samples of each prompt, microgroup by microgroup, prompt-major.

        `record_snapshot` keeps each step's debug data (branch outputs, SDE mean/std/noise) for
        `snapshot.save_snapshot`; `progress` shows a tqdm bar over denoising steps on stderr; `should_stop` is
        called before every denoising step, and a true answer raises `RolloutCancelled` (a server's client left).
        """
        if not prompts:
            raise ValueError("rollout needs at least one prompt")
        size = params.rollout_microgroup_size or n_per_prompt
        if n_per_prompt < 1 or n_per_prompt % size:
            raise ValueError(f"n_per_prompt={n_per_prompt} must be a positive multiple of rollout_microgroup_size="
                             f"{size}: every microgroup has the train micro-batch's size (DESIGN 3, condition 4)")
        grid = latent_grid(params.height, params.width)
        sigmas, timesteps = qwen_image_schedule(self.scheduler_config, params.steps, grid[0] * grid[1], self.device)
        negative = self._encode(params.negative_prompt, params) if params.cfg else None
        microgroups, images = [], []
        with tqdm(total=len(prompts) * n_per_prompt // size * params.steps, disable=not progress, unit="step") as bar:
            for p, prompt in enumerate(prompts):
                positive = self._encode(prompt, params)
                for m, first in enumerate(range(0, n_per_prompt, size)):
                    ks = range(first, first + size)
                    gens = [torch.Generator().manual_seed(derive_seed(seed, _NOISE_STREAM, p, k)) for k in ks]
                    mg = self._denoise(p, [p * n_per_prompt + k for k in ks], gens, (positive, negative), grid,
                                       (sigmas, timesteps), params, self._sde_steps(params, seed, p, m),
                                       record_snapshot, bar, should_stop)
                    microgroups.append(mg)
                    if decode:
                        images.append(self.vae.decode(mg.latents[-1], params.height, params.width))
        info = {"checkpoint": self.checkpoint, "patch_group": self.patch_group,
                "disabled_patches": list(self.disabled_patches),
                "patches_applied": list(self.transformer.patches_applied),
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device)}
        if record_snapshot:
            info["weights_checksum"] = self.weights_checksum()
        return Rollout(list(prompts), n_per_prompt, params, seed, microgroups,
                       torch.cat(images) if decode else None, info)

    def _encode(self, prompt: str, params: SamplingParams) -> torch.Tensor:
        # One prompt per text-encoder call: its embeddings then never depend on the other prompts of a request.
        return encode_prompts(self.tokenizer, self.text_encoder, [prompt], params.max_sequence_length)[0]

    @staticmethod
    def _sde_steps(params: SamplingParams, seed: int, p: int, m: int) -> list[int]:
        if params.sampler == "ode":
            return []
        if params.num_sde_steps is None:
            return list(range(params.steps))
        g = torch.Generator().manual_seed(derive_seed(seed, _WINDOW_STREAM, p, m))
        return draw_sde_window(params.steps, params.num_sde_steps, params.sde_window, g)

    def _denoise(self, p: int, sample_indices: list[int], gens: list[torch.Generator],
                 text: tuple[torch.Tensor, torch.Tensor | None], grid: tuple[int, int],
                 schedule: tuple[torch.Tensor, torch.Tensor], params: SamplingParams, sde_steps: list[int],
                 record: bool, bar: tqdm, should_stop: Callable[[], bool] | None = None) -> Microgroup:
        """One microgroup of prompt `p` through the whole denoise loop; `gens[i]` is sample i's generator."""
        b, (sigmas, timesteps) = len(gens), schedule
        # One prompt per microgroup: every row has the same length, so both masks collapse to None.
        pos_embeds, pos_mask = collate_text([text[0]] * b)
        neg_embeds, neg_mask = collate_text([text[1]] * b) if text[1] is not None else (None, None)
        # The pipeline's prepare_latents: [B, 1, C/4, 2·rows, 2·cols] drawn in the latent dtype, then packed.
        channels = self.transformer.config.in_channels // 4
        x = pack_latents(sample_noise((1, channels, 2 * grid[0], 2 * grid[1]), gens, self.dtype, self.device))
        latents, guided, records = [x], [], [] if record else None
        log_probs = torch.zeros(params.steps, b, dtype=torch.float32, device=self.device)
        for i in range(params.steps):
            if should_stop is not None and should_stop():
                raise RolloutCancelled(f"stopped before step {i + 1} of {params.steps}")
            # The schedule's fp32 timestep; the engine model's timestep path rounds it as the pipeline does
            # (`t.to(bf16) / 1000`) under the qwen_image patch group, and keeps fp32 on the fast path.
            t = timesteps[i].expand(b)
            pos = self.forward(x, pos_embeds, t, grid, pos_mask)
            neg = self.forward(x, neg_embeds, t, grid, neg_mask) if neg_embeds is not None else None
            v = true_cfg(pos, neg, params.cfg_scale) if neg is not None else pos
            if i in sde_steps:
                noise = sample_noise(x.shape[1:], gens, torch.float32, self.device)
                if params.sampler == "sde":
                    step = sde_step(x, v, sigmas[i], sigmas[i + 1], sigmas[1], params.noise_level, noise, x.dtype)
                else:
                    step = cps_step(x, v, sigmas[i], sigmas[i + 1], params.noise_level, noise, x.dtype)
                log_probs[i] = step.log_prob
                guided.append(v)
                if record:
                    records.append(StepRecord(pos, neg, v, step.mean, step.std, noise))
                x = step.x_next
            else:
                if record:
                    records.append(StepRecord(pos, neg, v))
                x = ode_step(x, v, sigmas[i], sigmas[i + 1])
            latents.append(x)
            bar.update()
        return Microgroup(
            prompt_index=p, sample_indices=sample_indices, img_shape=grid,
            latents=torch.stack(latents), sigmas=sigmas, timesteps=timesteps, log_probs=log_probs,
            sde_steps=sde_steps, guided_outputs=torch.stack(guided) if guided else x.new_empty(0, *x.shape),
            prompt_embeds=pos_embeds, prompt_mask=pos_mask, negative_prompt_embeds=neg_embeds,
            negative_prompt_mask=neg_mask, records=records)

