"""A model family as a value: what the generic engine, parity probe, checkpoint writer and (from G1 phase 2) the
trainer need to know about one family, declared as data and small functions in `trueflow/models/<family>/family.py`
as `FAMILY`. Generic code takes a `ModelFamily` and never imports a family module (tests/test_imports.py).

Fields that point at heavy code (the VAE, the text encoder, diffusers' schedule and reference model) are small
functions that import it when called, so that reading a spec loads neither diffusers' models nor transformers.
docs/families.md describes each field and the steps to add a family.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import nn

from ..collate import Cond
from .tp_plan import TPPlan
from ..patches import PatchGroup

T = TypeVar("T")
Grid = tuple[int, ...]  # the token grid of one sample: (rows, cols) for images, (frames, rows, cols) for video


def lazy(module: str, name: str) -> Callable[..., Any]:
    """`module.name`, imported when first called: a spec field that points at heavy code (diffusers' schedule and
    VAE, the reference model, the checkpoint writer) without loading it when the spec is read."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = f"lazy({module}.{name})"
    return call


class TPRank(Protocol):
    """What a tensor-parallel engine model knows of its group: `parallel.comm.TPGroup` (which sits above models)."""

    rank: int
    size: int
    group: torch.distributed.ProcessGroup | None


class EngineModel(nn.Module):
    """The base of every family's engine model (`EngineSide.build_model` returns one): the attributes the engine
    keeps on a built model, declared for the type checker (annotations only: nothing is set here, each is set where
    the comment says; `nn.Module.__getattr__` would type them as tensors or modules)."""

    lora_merge: bool  # the model's __init__ (True), a parity patch group's `set_on` (False)
    family: ModelFamily  # `engine.weights.build_engine_transformer`, `parallel.engine.build_tp_engine_transformer`
    patches_applied: list[str]  # `models.apply_patch_group`
    lora_arena: object | None  # `engine.lora_arena.update_lora_packed` (its `LoraArena`: the engine is above models)
    tp: TPRank  # a tensor-parallel rank's model only (`build_tp_engine_transformer`)
    tp_layers: list[str]  # likewise: its swapped engine module names
    shared_base: bool  # a model on the train side's base tensors only (`engine.weights.share_engine_transformer`)


class BuildModel(Protocol):
    def __call__(self, config: dict, device: Any = ..., dtype: torch.dtype = ...) -> EngineModel:
        """A transformer config -> the family's engine model on `device` in `dtype`, parameters unset."""


class ParsePeft(Protocol):
    def __call__(self, state_dict: Mapping[str, T], /) -> dict[str, tuple[T, T]]:
        """PEFT-named LoRA tensors (or their shapes) -> {diffusers module: (A, B)}; WeightLoadError if not."""


class SetLora(Protocol):
    def __call__(self, model: nn.Module, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float,
                 merge: bool, check_only: bool = False) -> None:
        """Install `{diffusers module: (A, B)}` (merged into the weights or kept as adapters), all or nothing."""


class DiffusersModuleName(Protocol):
    def __call__(self, engine_name: str, slot: int | None = None, /) -> str:
        """An engine module (and packed slot) -> the diffusers module it holds: `map_module_name`'s inverse."""


class Schedule(Protocol):
    def __call__(self, scheduler_config: Mapping[str, Any], num_steps: int, image_seq_len: int,
                 device: torch.device | str | None = None, /) -> tuple[torch.Tensor, torch.Tensor]:
        """`(sigmas [T+1], timesteps [T] or per token [T, S])`, fp32, as the pipeline's scheduler sets them."""


class BuildTransformer(Protocol):
    def __call__(self, size_or_config: str | Mapping[str, Any], seed: int = ..., dtype: torch.dtype = ...,
                 device: str | torch.device = ...) -> nn.Module:
        """diffusers' transformer of a preset size (or a config) with seeded random weights, in `dtype` on `device`."""


class ProbeInputs(Protocol):
    def __call__(self, config: dict, batch: int, text_len: int, resolution: int, dtype: torch.dtype, seed: int,
                 device: torch.device | str, /) -> dict:
        """The parity probe's seeded inputs: hidden_states, timestep (fp32 schedule t), grid, cond (a batch's
        `Cond`)."""


class Decoder(Protocol):
    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int) -> torch.Tensor:
        """Packed latents -> uint8 images `[B, height, width, 3]` (one frame) or videos `[B, num_frames, height,
        width, 3]`, on the CPU."""


@dataclass(frozen=True)
class EngineSide:
    """The engine's DiT and the map between its parameters and diffusers' tensor names. The built model is called
    `model(hidden_states=x, timestep=t, grid=grid, **cond)`: `t` the fp32 schedule timestep(s), `[B]` or per token
    `[B, S]` (the model's timestep path rounds it as the pipeline does under the family's patch group)."""

    build_model: BuildModel  # transformer config -> model, parameters unset
    load_weights: Callable[[nn.Module, dict[str, torch.Tensor]], None]  # diffusers-named tensors, all or nothing
    parse_peft_state_dict: ParsePeft
    set_lora: SetLora  # (model, {diffusers module: (A, B)}, scale, merge, check_only=False)
    map_module_name: Callable[[str], tuple[str, int | None]]  # diffusers module -> (engine module, packed slot)
    diffusers_module_name: DiffusersModuleName  # (engine module, slot=None) -> diffusers module: the inverse
    comparable_modules: tuple[type, ...]  # engine modules whose output means the diffusers module's of that name
    # the attention kernel a built model runs (for reports); it takes the family's own model class (`Any`: the generic
    # spec cannot name it, and reads its blocks)
    attention_backend: Callable[[Any], str]
    tp_plan: TPPlan | None = None  # tensor-parallel shard plan (docs/tensor-parallel.md); None: TP 1 only
    # The checkpoint's tensors (diffusers names) that `load_weights` drops: left unread on load, so never sent to a
    # rank (LTX-2.3's audio stream). None: it reads every tensor.
    drops: Callable[[str], bool] | None = None


@dataclass(frozen=True)
class PatchGroupSpec:
    """One rollout patch group: the group for the default train attention backend, and the group for a train side
    on another diffusers backend (`name:backend`), whose `attention_kernel` patch pins the kernel that backend
    runs (`train_backends`: diffusers backend -> engine kernel)."""

    group: PatchGroup
    make: Callable[[str], PatchGroup]
    train_backends: Mapping[str, str]


@dataclass(frozen=True)
class PipelineSide:
    """The pipeline's pieces around the DiT, each bitwise as the family's diffusers pipeline computes it."""

    folders: tuple[str, ...]  # sub-folders a whole pipeline folder has, besides transformer/
    pixels_per_token: int  # image sides are multiples of this (VAE factor x patch)
    size_reason: str  # why, in a few words, for the error message
    max_text_tokens: int  # the text encoder's window (max_sequence_length cap)
    load_text: Callable[[Path, torch.device, torch.dtype], tuple[Any, Any]]  # -> (tokenizer, text module)
    # (tokenizer, text module, prompts, max tokens) -> per prompt its conditioning, entries without the batch dim
    encode_prompts: Callable[[Any, Any, list[str], int], list[Cond]]
    text_streams: Mapping[str, str]  # conditioning entries padded batch-locally: stream key -> its mask key
    latent_grid: Callable[[int, int, int], Grid]  # (height, width, num_frames) -> token grid; ValueError if refused
    noise_shape: Callable[[Any, Grid], tuple[int, ...]]  # (engine model config, grid) -> one sample's noise shape
    # (without the batch dim: the engine draws each sample from its own generator and stacks them)
    pack_latents: Callable[[torch.Tensor], torch.Tensor]  # noise `[B, *noise_shape[1:]]` -> tokens `[B, S, C]`
    schedule: Schedule  # (scheduler config, steps, tokens, device)
    load_decoder: Callable[[Path, torch.device, torch.dtype], Decoder]
    latent_dtype: torch.dtype | None = None  # what the pipeline keeps latents in across steps; None: the model's
    # (model output, latents, sigma) -> the velocity the pipeline steps with; None: the output itself
    model_output: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (sampling params) -> the model's non-tensor keyword inputs a request sets (LTX-2.3: {"fps": params.fps}), passed
    # to the engine model and the train forward alike and recorded with each microgroup; None: there are none
    static_inputs: Callable[[Any], dict[str, Any]] | None = None
    scheduler_config: Mapping[str, Any] = field(default_factory=dict)  # what a checkpoint without one schedules by
    # Image-to-video: (decoder, image path, height, width) -> the first frame's conditioning entries, added to both
    # branches of every sample (the decoder holds the VAE that encodes it); None: the family takes no image
    image_cond: Callable[[Any, str, int, int], Cond] | None = None
    # (final latents, the positive conditioning) -> what the pipeline decodes (TI2V-5B's image-to-video puts the
    # image's latents back into the first frame); None: the final latents themselves
    final_latents: Callable[[torch.Tensor, Cond], torch.Tensor] | None = None


@dataclass(frozen=True)
class TrainSide:
    """The train side's reference model, as data: diffusers' class by name, the PEFT LoRA targets, the FSDP shard
    units, and the call the family's pipeline makes, as the trainer and the parity probe run it."""

    transformer_class: str  # e.g. "QwenImageTransformer2DModel"; its config.json `_class_name`
    lora_targets: tuple[str, ...]  # PEFT `target_modules`
    shard_units: tuple[str, ...]  # ModuleLists whose items are each one FSDP unit (the rest is one more)
    parity_backend: str  # diffusers attention backend the default patch group pairs with
    masked_backend: str  # where a batch with a text mask goes (the parity backend refuses masks)
    timestep: Callable[[torch.Tensor, torch.dtype], torch.Tensor]  # schedule t (fp32) -> what the pipeline passes
    forward: Callable[..., torch.Tensor]  # (model, hidden_states, timestep(t), grid, cond, **static) -> prediction
    module: str = "diffusers"  # where `transformer_class` is found (a family written outside diffusers names its own)
    # `--train-kernels fused`: (built model) -> what it swapped; installs the engine's eager-exact fused kernels as
    # autograd Functions underneath the diffusers model, its forward's bits unchanged. None: the family has none.
    fused_kernels: Callable[[Any], list[str]] | None = None

    def model_class(self) -> type:
        """The diffusers model class (imported on call: the engine never needs it)."""
        return getattr(importlib.import_module(self.module), self.transformer_class)

    def backend(self, dtype: torch.dtype) -> str:
        """The attention backend the train side runs in `dtype` (the parity backend takes bf16/fp16 only)."""
        return self.parity_backend if dtype in (torch.bfloat16, torch.float16) else self.masked_backend


@dataclass(frozen=True)
class Presets:
    """Architecture sizes, the train side built from one with seeded random weights, and the checkpoint writer."""

    transformer_config: Callable[[str], dict]
    build_transformer: BuildTransformer  # (size or config, seed, dtype, device) -> diffusers model
    write_checkpoint: Callable[[Path, str, int, torch.dtype, Any], None]  # (empty folder, size, seed, dtype, device)


class GuidanceFormula(Protocol):
    __name__: str  # a function's (snapshots record it)

    def __call__(self, positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
        """The guided model output from the two branches' outputs (`models.cfg`: `plain_cfg`, `rescaled_cfg`);
        `scale` a python float, as the pipelines keep it."""


@dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance as the family's pipeline runs it; the engine's denoise loop, the trainer's re-score,
    the parity probe and the snapshot replays all take it from here (`engine.guidance.guide` runs it).

    `branches`: how the two branches run when `cfg_scale > 1`:
    - "separate": two forwards, positive then negative (QwenImagePipeline, WanPipeline, FluxPipeline's true CFG);
    - "batched": ONE forward of the rows `[negative × B, positive × B]` (latents and timestep repeated, the
      conditioning collated as one batch of 2B samples), its output chunked back in that order
      (StableDiffusion3Pipeline: `torch.cat([latents] * 2)` with `torch.cat([negative, positive])` embeddings);
    - "none": the family takes no CFG (`cfg_scale > 1` is refused; `formula` is None).
    `distilled_input`: the model keyword that takes a guidance-distilled scale (FLUX.1-dev: `guidance`, an fp32
    `[B]` tensor, the pipeline's `full([1], guidance_scale).expand(B)`), recorded as a conditioning entry of both
    branches; `distilled_default` the pipeline's default scale. None: the family has no such input.
    `per_expert_scale`: every expert after the first may take its own scale (`cfg_scale_2`; WanPipeline's
    `guidance_scale_2`, which defaults to `guidance_scale`).
    `negative_prompt`: the negative prompt of a request that names none (`SamplingParams.negative_prompt` None):
    trueflow's `" "` for Qwen-Image (its recipe's), the pipeline's `""` for SD3; None where the pipeline's default is
    no negative prompt and it runs no CFG without one (FluxPipeline's true CFG needs `negative_prompt`):
    `cfg_scale > 1` is then refused unless the request names one."""

    branches: Literal["separate", "batched", "none"]
    formula: GuidanceFormula | None = None
    distilled_input: str | None = None
    distilled_default: float | None = None
    per_expert_scale: bool = False
    negative_prompt: str | None = " "

    def __post_init__(self) -> None:
        if self.branches not in ("separate", "batched", "none"):
            raise ValueError(f"Guidance.branches {self.branches!r}: choose separate, batched or none")
        if (self.formula is None) != (self.branches == "none"):
            raise ValueError("Guidance: a formula goes with separate or batched branches, none with branches='none'")
        if (self.distilled_input is None) != (self.distilled_default is None):
            raise ValueError("Guidance: distilled_input and distilled_default go together")

    @property
    def takes_cfg(self) -> bool:
        return self.branches != "none"


NO_GUIDANCE = Guidance("none")


@dataclass(frozen=True)
class Expert:
    """One transformer of a family's pipeline and the schedule timesteps it serves: `low <= t < high`, `t` the
    step's fp32 schedule timestep (0..1000; a per-token schedule's step is judged by its largest timestep, as
    WanPipeline's `expand_timesteps` compares the step's `t` while its first-frame tokens get 0). `name` is the
    pipeline component (model_index.json key), which is also its sub-folder."""

    name: str
    low: float = -math.inf
    high: float = math.inf


class ExpertsOf(Protocol):
    def __call__(self, model_index: Mapping[str, Any], scheduler_config: Mapping[str, Any]) -> tuple[Expert, ...]:
        """A checkpoint's experts, in the pipeline's order, from its model_index.json (the pipeline config; {} for a
        folder without one) and its scheduler config; ValueError naming what is inconsistent."""


class LayoutOf(Protocol):
    def __call__(self, model_index: Mapping[str, Any],
                 component_config: Callable[[str], Mapping[str, Any] | None]) -> "ModelFamily":
        """The family's spec for a pipeline folder, from its model_index.json and its components' config.json
        (`component_config("vae")`; None where the folder has none), with the same name; ValueError naming what is
        inconsistent."""


def one_expert(model_index: Mapping[str, Any], scheduler_config: Mapping[str, Any]) -> tuple[Expert, ...]:
    """A pipeline with one transformer, `transformer/`, serving every step."""
    return (Expert("transformer"),)


def boundary_experts(model_index: Mapping[str, Any], scheduler_config: Mapping[str, Any]) -> tuple[Expert, ...]:
    """WanPipeline's two stages (`pipelines/wan/pipeline_wan.py`, `__call__`): with a `transformer_2` component and
    the pipeline config's `boundary_ratio`, the boundary is `boundary_ratio · num_train_timesteps`; `transformer`
    serves `t >= boundary` (high noise), `transformer_2` the rest. Without both (Wan2.1, TI2V-5B: `transformer_2`
    null), `transformer` alone."""
    second = model_index.get("transformer_2")
    has_second = second is not None and any(v is not None for v in (second if isinstance(second, list) else [second]))
    ratio = model_index.get("boundary_ratio")
    if has_second != (ratio is not None):
        raise ValueError("model_index.json names transformer_2 without a boundary_ratio" if has_second else
                         "model_index.json has a boundary_ratio but no transformer_2 component")
    if not has_second:
        return one_expert(model_index, scheduler_config)
    if not (isinstance(ratio, (int, float)) and 0 < ratio < 1):
        raise ValueError(f"model_index.json boundary_ratio must be a number in (0, 1), got {ratio!r}")
    boundary = ratio * scheduler_config.get("num_train_timesteps", 1000)
    return Expert("transformer", low=boundary), Expert("transformer_2", high=boundary)


def expert_at(experts: Sequence[Expert], timestep: torch.Tensor) -> int:
    """The index of the expert serving one step, given its fp32 schedule timestep(s). The comparison is a tensor
    comparison with the python-float bounds, as WanPipeline's `t >= boundary_timestep`."""
    t = timestep.max() if timestep.ndim else timestep
    for k, e in enumerate(experts):
        if bool(t >= e.low) and bool(t < e.high):
            return k
    raise ValueError(f"no expert serves timestep {float(t)} (experts: "
                     + ", ".join(f"{e.name} [{e.low}, {e.high})" for e in experts) + ")")


def expert_prefix(names: Sequence[str], k: int) -> str:
    """The prefix of expert k's tensor names (of the experts `names`, in order) wherever several experts' tensors
    travel as one state dict (LoRA sync, checksums, the trainer's parameters and checkpoints): none for the first
    expert, `"<name>."` for the others, so a one-expert family's names are diffusers' own, unchanged."""
    return "" if k == 0 else f"{names[k]}."


def split_by_expert(state: Mapping[str, Any], names: Sequence[str]) -> list[dict[str, Any]]:
    """A state dict of several experts' tensors (`expert_prefix` names) -> one dict per expert, prefixes removed."""
    out: list[dict[str, Any]] = [{} for _ in names]
    prefixes = [(k, expert_prefix(names, k)) for k in range(1, len(names))]
    for key, value in state.items():
        k, p = next(((k, p) for k, p in prefixes if key.startswith(p)), (0, ""))
        out[k][key[len(p):]] = value
    return out


@dataclass(frozen=True)
class ModelFamily:
    name: str  # the folder under trueflow/models, `--family`
    pipeline_class: str  # the `_class_name` of a checkpoint's model_index.json
    default: bool  # the family used where neither a checkpoint nor `--family` names one (exactly one has it)
    blocks: tuple[str, ...]  # ModuleLists of repeated blocks, named alike on both sides (`--layer-report blocks`)
    engine: EngineSide
    patch_groups: Mapping[str, PatchGroupSpec]
    pipeline: PipelineSide
    probe_inputs: ProbeInputs  # (config, batch, text_len, resolution, dtype, seed, device) -> the probe's
    # seeded inputs: hidden_states, timestep (fp32 schedule t), grid, cond (a batch's `Cond`)
    train: TrainSide
    presets: Presets
    guidance: Guidance  # classifier-free guidance as the pipeline runs it (and a distilled scale, per-expert scales)
    pipeline_module: str = "diffusers"  # where `pipeline_class` is found (a family outside diffusers names its own)
    experts: ExpertsOf = one_expert  # the checkpoint's transformers and the timesteps each serves
    # A family whose pipeline folders come in several layouts of one pipeline class (Wan2.2's A14B and TI2V-5B: other
    # VAE compressions, a timestep per token) gives the spec of one folder's layout; `family_for_checkpoint` applies
    # it. None: one layout, this spec.
    layout: LayoutOf | None = None

    def pipeline_type(self) -> type:
        """The pipeline class, whose `save_lora_weights` writes the trainer's LoRA files (imported on call)."""
        return getattr(importlib.import_module(self.pipeline_module), self.pipeline_class)
