"""The model runner: one engine transformer (CUDA-graphed on CUDA) and the denoise loop of one microgroup over it.

Each step runs two separate branch forwards (positive, then negative), true CFG, then an ODE step or, inside the
SDE window, a stochastic step with its log-prob. Everything family-specific (the initial noise's layout and its
packing into tokens) comes from the model family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from ..collate import collate_text
from ..layers.linear import Linear
from ..models.spec import Grid, ModelFamily
from ..sync.checksum import tensors_checksum
from . import weights
from .cuda_graph import GraphedForward
from .guidance import true_cfg
from .sampling_params import SamplingParams
from .samplers import cps_step, ode_step, sample_noise, sde_step
from .trajectory import Microgroup, StepRecord


class RolloutCancelled(Exception):
    """A rollout stopped between denoising steps because its `should_stop` said so; nothing is returned."""


class ModelRunner:
    """Owns the engine transformer: its forwards (replayed CUDA graphs, one per shape, bitwise equal to eager;
    `cuda_graphs=False` runs eagerly), its weights and LoRA, and the denoise loop."""

    def __init__(self, transformer: torch.nn.Module, family: ModelFamily, device: torch.device, dtype: torch.dtype,
                 cuda_graphs: bool = True):
        self.transformer, self.family, self.device, self.dtype = transformer, family, device, dtype
        self.forward = GraphedForward(transformer, enabled=cuda_graphs and device.type == "cuda")

    # -- weights -------------------------------------------------------------------------------------------
    def update_lora(self, peft_state_dict: dict[str, torch.Tensor], scale: float, merge_mode: str | None = None) -> None:
        weights.update_lora(self.transformer, peft_state_dict, scale, merge_mode)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.family.engine.load_weights(self.transformer, state_dict)

    def lora_checksum(self) -> str:
        return tensors_checksum(weights.lora_state(self.transformer))

    def weights_checksum(self) -> str:
        tensors = dict(self.transformer.named_parameters())
        tensors.update({f"lora.{k}": v for k, v in weights.lora_state(self.transformer).items()})
        scales = sorted({a.scale for m in self.transformer.modules() if isinstance(m, Linear) for a in m.adapters if a})
        return tensors_checksum(tensors, extra=f"lora_scales={scales}")

    # -- denoise loop --------------------------------------------------------------------------------------
    def denoise(self, p: int, sample_indices: list[int], gens: list[torch.Generator],
                text: tuple[torch.Tensor, torch.Tensor | None], grid: Grid,
                schedule: tuple[torch.Tensor, torch.Tensor], params: SamplingParams, sde_steps: list[int],
                record: bool, bar: tqdm, should_stop: Callable[[], bool] | None = None) -> Microgroup:
        """One microgroup of prompt `p` through the whole denoise loop; `gens[i]` is sample i's generator."""
        b, (sigmas, timesteps) = len(gens), schedule
        pipe = self.family.pipeline
        # One prompt per microgroup: every row has the same length, so both masks collapse to None.
        pos_embeds, pos_mask = collate_text([text[0]] * b)
        neg_embeds, neg_mask = collate_text([text[1]] * b) if text[1] is not None else (None, None)
        # The pipeline's prepare_latents: drawn in the latent dtype, then packed into tokens.
        shape = pipe.noise_shape(self.transformer.config, grid)
        x = pipe.pack_latents(sample_noise(shape, gens, self.dtype, self.device))
        latents, guided, records = [x], [], [] if record else None
        log_probs = torch.zeros(params.steps, b, dtype=torch.float32, device=self.device)
        for i in range(params.steps):
            if should_stop is not None and should_stop():
                raise RolloutCancelled(f"stopped before step {i + 1} of {params.steps}")
            # The schedule's fp32 timestep; the engine model's timestep path rounds it as the pipeline does
            # under the family's patch group, and keeps fp32 on the fast path.
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
