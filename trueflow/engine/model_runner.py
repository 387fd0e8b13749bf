"""The model runner: one engine transformer (CUDA-graphed on CUDA) and the denoise loop of one microgroup over it.

Each step runs two separate branch forwards (positive, then negative; in the batch-invariant mode one forward of
both), true CFG, then an ODE step or, inside the SDE window, a stochastic step with its log-prob. Everything
family-specific (the conditioning's streams, the initial noise's layout and its packing into tokens, the latents'
dtype, what the pipeline makes of the model's output) comes from the model family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from ..collate import Cond, collate_cond, concat_cond
from ..layers.linear import Linear
from ..models.spec import Grid, ModelFamily
from ..sync.buckets import Bucket, unpack
from ..sync.checksum import tensors_checksum
from . import weights
from .lora_arena import as_buckets, lora_checksum, update_lora_packed
from .batcher import ForwardBatcher
from .cuda_graph import GraphedForward
from .guidance import true_cfg
from .interface import RolloutCancelled
from .sampling_params import SamplingParams
from .samplers import cps_step, ode_step, sample_noise, sde_step
from .trajectory import Microgroup, StepRecord


class ModelRunner:
    """Owns the engine transformer: its forwards (replayed CUDA graphs, one per shape, bitwise equal to eager;
    `cuda_graphs=False` runs eagerly), its weights and LoRA, and the denoise loop."""

    def __init__(self, transformer: torch.nn.Module, family: ModelFamily, device: torch.device, dtype: torch.dtype,
                 cuda_graphs: bool = True):
        self.transformer, self.family, self.device, self.dtype = transformer, family, device, dtype
        self.forward: Callable[..., torch.Tensor] = GraphedForward(transformer,
                                                                   enabled=cuda_graphs and device.type == "cuda")
        # The batch-invariant mode (its patch marks the model): a branch's rows are the bits of its own call there, so
        # the CFG branches run as one forward, and several rollouts' forwards may merge (`merge_forwards`).
        self.batch_invariant = bool(getattr(transformer, "batch_invariant", False))
        self.batcher: ForwardBatcher | None = None

    def merge_forwards(self) -> ForwardBatcher:
        """From now on, rollouts run concurrently (each inside `batcher.participant()`) share one forward per round
        (`engine.batcher`); batch-invariant mode only. A rollout alone keeps its CUDA graphs; a merged batch runs
        eagerly (its shape changes with what merges: a graph per composition would not pay)."""
        if not self.batch_invariant:
            raise ValueError("merging rollouts' forwards needs the batch-invariant mode (--batch-invariant): outside "
                             "it a sample's bits depend on the batch it runs in")
        if self.batcher is None:
            self.batcher = ForwardBatcher(self.forward, self.transformer, self.family.pipeline.text_streams)
            self.forward = self.batcher
        return self.batcher

    # -- weights -------------------------------------------------------------------------------------------
    def update_lora(self, state: dict[str, torch.Tensor] | list[Bucket], scale: float,
                    merge_mode: str | None = None) -> None:
        """Install a LoRA given as PEFT-format tensors or as buckets of them (`sync.buckets`). Packed, a same-layout
        update takes the arena's fast path (`lora_arena`); a tensor-parallel rank takes its slice of the tensors."""
        if getattr(self.transformer, "tp", None) is not None:
            from ..parallel.engine import update_lora_tp

            update_lora_tp(self.transformer, unpack(state) if isinstance(state, list) else state, scale, merge_mode)
        elif (buckets := state if isinstance(state, list) else as_buckets(state)) is not None:
            update_lora_packed(self.transformer, buckets, scale, merge_mode)
        else:  # installs by copying into the arena's views where shapes match: the arena no longer says what is held
            self.transformer.lora_arena = None
            weights.update_lora(self.transformer, state, scale, merge_mode)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        if getattr(self.transformer, "tp", None) is not None:
            raise ValueError("full-weight updates of a tensor-parallel engine are not supported: load the weights "
                             "with --tp 1, or start the engine from a checkpoint holding them")
        self.family.engine.load_weights(self.transformer, state_dict)
        self.transformer.lora_arena = None  # the LoRA was cleared: its arena's buffers go too

    def lora_checksum(self) -> str:
        return lora_checksum(self.transformer)

    def weights_checksum(self) -> str:
        tensors = dict(self.transformer.named_parameters())
        tensors.update({f"lora.{k}": v for k, v in weights.lora_state(self.transformer).items()})
        scales = sorted({a.scale for m in self.transformer.modules() if isinstance(m, Linear) for a in m.adapters if a})
        return tensors_checksum(tensors, extra=f"lora_scales={scales}")

    # -- denoise loop --------------------------------------------------------------------------------------
    def denoise(self, p: int, sample_indices: list[int], gens: list[torch.Generator],
                conds: tuple[Cond | list[Cond], Cond | None], grid: Grid,
                schedule: tuple[torch.Tensor, torch.Tensor], params: SamplingParams, sde_steps: list[int],
                record: bool, bar: tqdm, should_stop: Callable[[], bool] | None = None) -> Microgroup:
        """One microgroup of prompt `p` through the whole denoise loop; `gens[i]` is sample i's generator;
        `conds` the prompt's positive and negative conditioning, one sample's entries (no batch dim); the positive one
        may be a list, one entry per sample (several prompts in one microgroup: the batch-invariant mode)."""
        b, (sigmas, timesteps) = len(gens), schedule
        pipe = self.family.pipeline
        # One prompt per microgroup: every row has the same length, so every mask collapses to None. (In the
        # batch-invariant mode a microgroup may hold several prompts, one entry per sample, collated with a mask.)
        positive = conds[0] if isinstance(conds[0], list) else [conds[0]] * b
        pos = collate_cond(positive, pipe.text_streams)
        neg = collate_cond([conds[1]] * b, pipe.text_streams) if conds[1] is not None else None
        static = pipe.static_inputs(params) if pipe.static_inputs is not None else {}
        # The pipeline's prepare_latents: drawn in the latent dtype, then packed into tokens. Made contiguous: a
        # packing may be a strided view (LTX-2.3's transpose), and a GEMM on a strided input can take another kernel
        # than on the contiguous micro-batch the train side stacks from the record (and the CUDA graphs need it).
        shape = pipe.noise_shape(self.transformer.config, grid)
        x = pipe.pack_latents(sample_noise(shape, gens, pipe.latent_dtype or self.dtype, self.device)).contiguous()
        latents, guided, records = [x], [], [] if record else None
        log_probs = torch.zeros(params.steps, b, dtype=torch.float32, device=self.device)
        for i in range(params.steps):
            if should_stop is not None and should_stop():
                raise RolloutCancelled(f"stopped before step {i + 1} of {params.steps}")
            # The schedule's fp32 timestep (one, or one per token); the engine model's timestep path rounds it as
            # the pipeline does under the family's patch group, and keeps fp32 on the fast path.
            t = timesteps[i].expand(b, *timesteps.shape[1:])
            # The model reads the latents in its own dtype (a no-op where the pipeline keeps them in it).
            model_input = x.to(self.dtype)
            pos_out, neg_out = self._branches(model_input, t, grid, static, pos, neg)
            v = true_cfg(pos_out, neg_out, params.cfg_scale) if neg_out is not None else pos_out
            if pipe.model_output is not None:
                v = pipe.model_output(v, x, sigmas[i])
            if i in sde_steps:
                noise = sample_noise(x.shape[1:], gens, torch.float32, self.device)
                if params.sampler == "sde":
                    step = sde_step(x, v, sigmas[i], sigmas[i + 1], sigmas[1], params.noise_level, noise, x.dtype)
                else:
                    step = cps_step(x, v, sigmas[i], sigmas[i + 1], params.noise_level, noise, x.dtype)
                log_probs[i] = step.log_prob
                guided.append(v)
                if record:
                    records.append(StepRecord(pos_out, neg_out, v, step.mean, step.std, noise))
                x = step.x_next
            else:
                if record:
                    records.append(StepRecord(pos_out, neg_out, v))
                x = ode_step(x, v, sigmas[i], sigmas[i + 1])
            latents.append(x)
            bar.update()
        return Microgroup(
            prompt_index=p, sample_indices=sample_indices, grid=grid,
            latents=torch.stack(latents), sigmas=sigmas, timesteps=timesteps, log_probs=log_probs,
            sde_steps=sde_steps, guided_outputs=torch.stack(guided) if guided else x.new_empty(0, *x.shape),
            cond=pos, negative_cond=neg, static=static, records=records)

    def _branches(self, x: torch.Tensor, t: torch.Tensor, grid: Grid, static: dict, pos: Cond,
                  neg: Cond | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The CFG branches' model outputs: two separate forwards (parity needs them: a batch of both runs other GEMM
        shapes), or in the batch-invariant mode one forward of both, whose rows are the two calls' bits."""
        if neg is None:
            return self.forward(hidden_states=x, timestep=t, grid=grid, **static, **pos), None
        if not self.batch_invariant:
            return (self.forward(hidden_states=x, timestep=t, grid=grid, **static, **pos),
                    self.forward(hidden_states=x, timestep=t, grid=grid, **static, **neg))
        both = self.forward(hidden_states=torch.cat([x, x]), timestep=torch.cat([t, t]), grid=grid, **static,
                            **concat_cond([pos, neg], self.family.pipeline.text_streams))
        return both[:x.shape[0]], both[x.shape[0]:]
