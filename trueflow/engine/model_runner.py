"""The model runner: the engine transformers (one per expert, each CUDA-graphed on CUDA) and the denoise loop of one
microgroup over them.

Each step runs on the expert that serves its timestep (`models.spec.Expert`, recorded per step), guided as the
family declares (`guidance.guide`: two separate branch forwards, one batched forward, or the positive branch alone;
in the batch-invariant mode always one batched forward, whose rows are the separate calls' bits), then an ODE step
or, inside the SDE window, a stochastic step with its log-prob. Everything family-specific (the
conditioning's streams, the initial noise's layout and its packing into tokens, the latents' dtype, what the
pipeline makes of the model's output) comes from the model family.

Where several experts' tensors travel as one state dict (a LoRA update, its checksum, the weights checksum), the
first expert's names are diffusers' own and another expert's are prefixed `"<expert>."` (`spec.expert_prefix`); a
one-expert engine therefore holds, sends and checksums exactly what it did before experts existed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import cast

import torch
from tqdm import tqdm

from ..collate import Cond, collate_cond
from ..layers.linear import Linear
from ..models.spec import EngineModel, Expert, Grid, ModelFamily, expert_at, expert_prefix, split_by_expert
from ..sync.buckets import Bucket, unpack
from ..sync.checksum import tensors_checksum
from ..sync.full_weights import weights_checksum
from ..models import lora
from ..models.weight_map import OwnedWeights
from . import weights
from .lora_arena import as_buckets, lora_checksum, update_lora_packed
from .batcher import ForwardBatcher
from .cuda_graph import GraphedForward
from .guidance import BranchForward, expert_scale, guide
from .interface import RolloutCancelled
from .sampling_params import SamplingParams
from .samplers import cps_step, ode_step, sample_noise, sde_step
from .trajectory import Microgroup, StepRecord


class ModelRunner:
    """Owns the engine transformers, one per expert (in the family's order for the checkpoint): their forwards
    (replayed CUDA graphs, one per shape and expert, bitwise equal to eager; `cuda_graphs=False` runs eagerly),
    their weights and LoRA, and the denoise loop."""

    def __init__(self, experts: Sequence[tuple[Expert, EngineModel]], family: ModelFamily, device: torch.device,
                 dtype: torch.dtype, cuda_graphs: bool = True):
        self.experts = tuple(e for e, _ in experts)
        self.names = [e.name for e in self.experts]
        self.transformers = [m for _, m in experts]
        self.transformer = self.transformers[0]
        self.family, self.device, self.dtype = family, device, dtype
        self.forwards: list[Callable[..., torch.Tensor]] = [
            GraphedForward(m, enabled=cuda_graphs and device.type == "cuda") for m in self.transformers]
        # The batch-invariant mode (its patch marks each model): a sample's rows are the bits of its own call there,
        # so the CFG branches run as one forward, a microgroup may hold several prompts, and several rollouts'
        # forwards may merge (`merge_forwards`).
        self.batch_invariant = all(getattr(m, "batch_invariant", False) for m in self.transformers)
        self.guidance = replace(family.guidance, branches="batched") if self.batch_invariant and \
            family.guidance.branches == "separate" else family.guidance
        self.batcher: ForwardBatcher | None = None

    def merge_forwards(self) -> ForwardBatcher:
        """From now on, rollouts run concurrently (each inside `batcher.participant()`) share one forward per round
        (`engine.batcher`; a round merges only calls on the same expert); batch-invariant mode only. A rollout alone
        keeps its CUDA graphs; a merged batch runs eagerly (its shape changes with what merges: a graph per
        composition would not pay)."""
        if not self.batch_invariant:
            raise ValueError("merging rollouts' forwards needs the batch-invariant mode (--batch-invariant): outside "
                             "it a sample's bits depend on the batch it runs in")
        if self.batcher is None:
            self.batcher = ForwardBatcher(self.forwards, self.transformers, self.family.pipeline.text_streams)
            self.forwards = [partial(self.batcher, k) for k in range(len(self.transformers))]
        return self.batcher

    # -- weights -------------------------------------------------------------------------------------------
    def update_lora(self, state: dict[str, torch.Tensor] | list[Bucket], scale: float,
                    merge_mode: str | None = None) -> None:
        """Install a LoRA given as PEFT-format tensors or as buckets of them (`sync.buckets`), replacing each
        expert's (an expert the update names no tensor of is left without one). Packed, a same-layout update takes
        the arena's fast path (`lora_arena`); a tensor-parallel rank takes its slice of the tensors. Several experts:
        each expert's part is checked before any is installed, so a bad update changes nothing."""
        if len(self.transformers) > 1:
            parts = split_by_expert(unpack(state) if isinstance(state, list) else state, self.names)
            for model, part in zip(self.transformers, parts):
                lora.update_lora(model, part, scale, merge_mode, check_only=True)
            for model, part in zip(self.transformers, parts):
                self._update_one(model, part, scale, merge_mode)
        else:
            self._update_one(self.transformer, state, scale, merge_mode)

    @staticmethod
    def _update_one(model: EngineModel, state: dict[str, torch.Tensor] | list[Bucket], scale: float,
                    merge_mode: str | None) -> None:
        if getattr(model, "tp", None) is not None:
            from ..parallel.engine import update_lora_tp

            update_lora_tp(model, unpack(state) if isinstance(state, list) else state, scale, merge_mode)
        elif (buckets := state if isinstance(state, list) else as_buckets(state)) is not None:
            update_lora_packed(model, buckets, scale, merge_mode)
        else:  # installs by copying into the arena's views where shapes match: the arena no longer says what is held
            model.lora_arena = None
            assert isinstance(state, dict)  # a list of buckets took the branch above
            lora.update_lora(model, state, scale, merge_mode)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace every expert's weights (diffusers names, `expert_prefix`ed after the first expert); all or nothing:
        each expert's part is checked before any is installed. An `OwnedWeights` state is kept without a copy where
        the expert runs eagerly; under CUDA graphs it is copied in place, since a graph reads the addresses it
        captured (adopting new tensors would make every graph re-capture: a forward or two per shape, each sync)."""
        if getattr(self.transformer, "tp", None) is not None:
            raise ValueError("full-weight updates of a tensor-parallel engine are not supported: load the weights "
                             "with --tp 1, or start the engine from a checkpoint holding them")
        if any(getattr(m, "shared_base", False) for m in self.transformers):
            raise ValueError("full-weight updates of an engine on the train side's base weights would write into "
                             "them: start the engine with a copy of its own (--no-share-base-weights)")
        if self.batcher is not None:  # its forwards are the batcher's partials now, not GraphedForwards
            raise ValueError("full-weight updates of an engine that merges rollouts' forwards (serve --max-merged) "
                             "are not supported: start it without --max-merged, or from a checkpoint holding them")
        owned = isinstance(state_dict, OwnedWeights)
        parts = split_by_expert(state_dict, self.names) if len(self.transformers) > 1 else [state_dict]
        # the runner's GraphedForwards (`merge_forwards` wraps them; a merged runner is refused above)
        parts = [OwnedWeights(p) if owned and not cast(GraphedForward, f).enabled else dict(p)
                 for p, f in zip(parts, self.forwards)]
        if len(parts) > 1:  # checked first, so a bad part changes no expert
            for model, part in zip(self.transformers, parts):
                weights.check_full(model, part)
        for model, part in zip(self.transformers, parts):
            self.family.engine.load_weights(model, part)
            model.lora_arena = None  # the LoRA was cleared: its arena's buffers go too

    def lora_checksum(self) -> str:
        if len(self.transformers) == 1:
            return lora_checksum(self.transformer)
        return tensors_checksum(self._prefixed(lora.lora_state))

    def weights_checksum(self) -> str:
        """`sync.full_weights.weights_checksum` of every expert's weights read back under diffusers' names, and its
        LoRA: what the trainer's checksum of a full-weight update equals once the update is in place."""
        scales = {a.scale for t in self.transformers for m in t.modules() if isinstance(m, Linear)
                  for a in m.adapters if a}
        return weights_checksum(self._prefixed(weights.full_state), self._prefixed(lora.lora_state), scales)

    def _prefixed(self, tensors_of: Callable[[EngineModel], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every expert's tensors under its `expert_prefix` names."""
        return {f"{expert_prefix(self.names, k)}{name}": t for k, model in enumerate(self.transformers)
                for name, t in tensors_of(model).items()}

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
        pos = collate_cond(conds[0] if isinstance(conds[0], list) else [conds[0]] * b, pipe.text_streams)
        neg = collate_cond([conds[1]] * b, pipe.text_streams) if conds[1] is not None else None
        static = pipe.static_inputs(params) if pipe.static_inputs is not None else {}
        # The pipeline's prepare_latents: drawn in the latent dtype, then packed into tokens. Made contiguous: a
        # packing may be a strided view (LTX-2.3's transpose), and a GEMM on a strided input can take another kernel
        # than on the contiguous micro-batch the train side stacks from the record (and the CUDA graphs need it).
        shape = pipe.noise_shape(self.transformer.config, grid)
        x = pipe.pack_latents(sample_noise(shape, gens, pipe.latent_dtype or self.dtype, self.device)).contiguous()
        records: list[StepRecord] | None
        latents, guided, records = [x], [], [] if record else None
        log_probs = torch.zeros(params.steps, b, dtype=torch.float32, device=self.device)
        # The expert of each step, from its schedule timestep (WanPipeline's boundary switch); recorded.
        schedule_t = timesteps.cpu()  # one transfer, not one per step and expert
        step_experts = [expert_at(self.experts, schedule_t[i]) for i in range(params.steps)]
        branches = [_branch(forward, grid, static) for forward in self.forwards]
        for i in range(params.steps):
            if should_stop is not None and should_stop():
                raise RolloutCancelled(f"stopped before step {i + 1} of {params.steps}")
            # The schedule's fp32 timestep (one, or one per token); the engine model's timestep path rounds it as
            # the pipeline does under the family's patch group, and keeps fp32 on the fast path.
            t = timesteps[i].expand(b, *timesteps.shape[1:])
            # The model reads the latents in its own dtype (a no-op where the pipeline keeps them in it).
            out = guide(self.guidance, branches[step_experts[i]], x.to(self.dtype), t, pos, neg,
                        expert_scale(step_experts[i], params.cfg_scale, params.cfg_scale_2), pipe.text_streams)
            pos_out, neg_out, v = out.positive, out.negative, out.output
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
                if records is not None:  # `record`
                    records.append(StepRecord(pos_out, neg_out, v, step.mean, step.std, noise))
                x = step.x_next
            else:
                if records is not None:  # `record`
                    records.append(StepRecord(pos_out, neg_out, v))
                x = ode_step(x, v, sigmas[i], sigmas[i + 1])
            latents.append(x)
            bar.update()
        return Microgroup(
            prompt_index=p, sample_indices=sample_indices, grid=grid,
            latents=torch.stack(latents), sigmas=sigmas, timesteps=timesteps, log_probs=log_probs,
            sde_steps=sde_steps, guided_outputs=torch.stack(guided) if guided else x.new_empty(0, *x.shape),
            cond=pos, negative_cond=neg, experts=[self.names[k] for k in step_experts], static=static,
            records=records)


def _branch(forward: Callable[..., torch.Tensor], grid: Grid, static: dict) -> BranchForward:
    """One expert's forward as `guidance.guide` calls it, with the microgroup's grid and static inputs bound."""
    def branch(hidden_states: torch.Tensor, timestep: torch.Tensor, cond: Cond) -> torch.Tensor:
        return forward(hidden_states=hidden_states, timestep=timestep, grid=grid, **static, **cond)

    return branch
