"""The memory plan of a run: the bytes one GPU holds, from the parameter counts alone, so `trueflow train` can refuse a
full-parameter setting (`--no-use-lora`) that cannot fit before it loads anything, `--gradient-checkpointing auto`
can recompute the fewest blocks that make a run fit (`auto_checkpointing`), and docs/training.md's table (`table`) is
this code's output (tests/test_fullft.py checks the two agree).

Per rank of R, for P weights of which P_t are trained and P_e reach the engine (docs/precision.md's contract):
- the sharded training state: fp32 masters of every weight 4·P/R, fp32 gradients 4·P_t/R, the optimizer's moments
  8·P_t/R (`adamw`) or 4·P_t/R (`adamw_bf16`), the EMA 4·P_t/R unless `--ema-offload` moves it to the CPU;
- FSDP2's gathered bf16 compute copies: the unit being computed and the one prefetched, 2 · 2·P_unit;
- activations of one micro-batch of `rows` samples (twice its samples with true CFG: both branches keep theirs
  for the backward) of T tokens through L blocks of width d: 34·d bytes per token
  and block in bf16 (Korthikanti et al., arXiv 2205.05198, Sec. 4.1, Eq. 1 without its 5·a·s/h term: a fused
  attention kernel keeps no score matrix; its dropout masks make it an upper bound for a DiT, which has none);
  with activation checkpointing (diffusers' per-block `enable_gradient_checkpointing`) each block keeps only its
  input, 2·d, and one block's 34·d are live again during its recompute. Checkpointing the first k blocks alone
  (`activations.checkpoint_blocks`) peaks at the end of the forward, 34·d per block kept whole and 2·d per
  checkpointed one: the backward frees the later blocks' activations before it recomputes the first k, one at a time
  beside the kept inputs, 2·d·k + 34·d at most (`activation_units`);
- the co-located engine's bf16 weights, 2·P_e, whatever R (in the trainer's process or its own on the same GPU), none
  where it reads the train side's base (`shared_base`: a LoRA run on one rank);
- at each sync the gathered bf16 copies, 2·P_e more, while the engine still holds the old ones (gradients and
  activations are freed by then: the peak is the larger of the train step's and the sync's).
A LoRA run of P_l adapter weights holds its frozen base once in bf16, 2·P/R, and the adapter as a full-parameter run
holds its trained weights, (4 + 4 + 8 + 4)·P_l/R at most (masters, gradients, moments, EMA); its sync sends the LoRA
alone, which the plan leaves out (P_l is a fraction of a percent of P), as it leaves out the LoRA layers' own
activations (rank-wide, against the 34·d of a block).
A plan is compared with `USABLE` of the GPU's memory: the rest is the CUDA context, the allocator's fragmentation,
the text encoder's and VAE's weights. An engine on GPUs of its own (`--ray --rollout-gpus`, `--engine-url`) leaves
the engine terms off; the plan here is for the co-located placements, the default."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.spec import ModelFamily

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from .model import DiffusersTransformer, LoraSpec

GIB = 1 << 30
H200_GIB = 140.4  # 143,771 MiB (nvidia-smi of an H200 SXM)
USABLE = 0.9
ACT_PER_TOKEN_WIDTH = 34  # bytes per token, per unit of width, per block (module docstring)
MAX_RANKS = 1024


@dataclass(frozen=True)
class Model:
    """What the plan needs of a transformer: its weight counts, its block count and width."""

    params: int  # every weight
    trained: int  # those the train forward reaches (`full.reaches_output`): trained, and sent to the engine
    unit: int  # the largest FSDP unit's (one block)
    blocks: int
    width: int


@dataclass(frozen=True)
class Setting:
    rows: int  # samples in one train micro-batch
    tokens: int  # tokens per sample (latent + text)
    optimizer: str = "adamw"
    ema: bool = False
    ema_offload: bool = False
    checkpointing: bool = False  # every block (diffusers' `enable_gradient_checkpointing`)
    engine_colocated: bool = True
    checkpointed: int = 0  # the first blocks checkpointed, where not every one is (`--gradient-checkpointing auto`)
    lora: int | None = None  # a LoRA run's adapter weights (P_l); None: a full-parameter run
    shared_base: bool = False  # the co-located engine reads the train side's base on one rank (`--share-base-weights`)


def bytes_per_trained_param(s: Setting) -> int:
    """Gradient + moments + EMA, per trained weight (the fp32 master, 4, is counted over every weight)."""
    return 4 + (8 if s.optimizer == "adamw" else 4) + (4 if s.ema and not s.ema_offload else 0)


def activation_units(blocks: int, checkpointed: int) -> int:
    """A micro-batch's peak activation bytes per token and unit of width with the first `checkpointed` of `blocks`
    blocks checkpointed (module docstring): 34 per block kept whole and 2 per checkpointed block; with every block
    checkpointed, 2 per block and the last block's recompute, 34 (so checkpointing the last block too never lowers
    the peak: its recompute holds what it frees)."""
    if not 0 <= checkpointed <= blocks:
        raise ValueError(f"{checkpointed} checkpointed blocks of {blocks}")
    recompute = ACT_PER_TOKEN_WIDTH if checkpointed == blocks > 0 else 0
    return ACT_PER_TOKEN_WIDTH * (blocks - checkpointed) + 2 * checkpointed + recompute


def peak_bytes(m: Model, s: Setting, ranks: int) -> int:
    """The most one GPU of `ranks` holds (module docstring)."""
    engine = 2 * m.trained if s.engine_colocated and not (s.shared_base and ranks == 1) else 0
    acts = s.rows * s.tokens * m.width * activation_units(m.blocks, m.blocks if s.checkpointing else s.checkpointed)
    if s.lora is not None:  # the base frozen in bf16, the adapter trained; the sync sends the LoRA alone
        return math.ceil((2 * m.params + (4 + bytes_per_trained_param(s)) * s.lora) / ranks + 2 * 2 * m.unit + acts
                         + engine)
    sharded = (4 * m.params + bytes_per_trained_param(s) * m.trained) / ranks
    train = sharded + 2 * 2 * m.unit + acts + engine
    sync = sharded - 4 * m.trained / ranks + 2 * engine  # the gradients are freed before a sync
    return math.ceil(max(train, sync))


def fewest_checkpointed(m: Model, s: Setting, ranks: int, gpu_bytes: float) -> int | None:
    """The fewest first blocks to checkpoint for the setting to fit GPUs of `gpu_bytes` (None: not even all)."""
    return next((k for k in range(m.blocks + 1)
                 if peak_bytes(m, replace(s, checkpointing=False, checkpointed=k), ranks) <= USABLE * gpu_bytes), None)


def smallest_ranks(m: Model, s: Setting, gpu_bytes: float) -> int | None:
    """The fewest GPUs of `gpu_bytes` the setting fits on (None: none up to MAX_RANKS)."""
    return next((r for r in range(1, MAX_RANKS + 1) if peak_bytes(m, s, r) <= USABLE * gpu_bytes), None)


def _width(config: dict) -> int:
    return int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def from_counts(family: ModelFamily, config: dict, shapes: dict[str, tuple[int, ...]]) -> Model:
    """A `Model` from a transformer's config and its weights' names and shapes (diffusers' names)."""
    from .full import reaches_output

    numel = {k: math.prod(v) for k, v in shapes.items()}
    units: dict[str, int] = {}
    for name, n in numel.items():
        for unit in family.train.shard_units:
            if name.startswith(unit + "."):
                key = ".".join(name.split(".")[:2])
                units[key] = units.get(key, 0) + n
    return Model(params=sum(numel.values()), trained=sum(n for k, n in numel.items() if reaches_output(family, k)),
                 unit=max(units.values(), default=0), blocks=len(units), width=_width(config))


def checkpoint_shapes(checkpoint: str | Path, subfolder: str = "transformer") -> dict[str, tuple[int, ...]]:
    """Every weight's shape (diffusers' names), from the safetensors headers: nothing is loaded."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted((Path(checkpoint) / subfolder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def from_checkpoint(family: ModelFamily, checkpoint: str | Path, subfolder: str = "transformer") -> Model:
    """A `Model` read from a checkpoint's safetensors headers and config.json: nothing is loaded."""
    config = json.loads((Path(checkpoint) / subfolder / "config.json").read_text())
    return from_counts(family, config, checkpoint_shapes(checkpoint, subfolder))


def lora_weights(shapes: dict[str, tuple[int, ...]], spec: LoraSpec) -> int:
    """The weights of `spec`'s LoRA on a transformer of these weight shapes: rank·(in + out) for each linear weight
    whose module PEFT's own rule targets (`peft.tuners.tuners_utils.check_target_module_exists`)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    config = spec.peft_config()
    return sum(spec.rank * (shape[0] + shape[1]) for name, shape in shapes.items()
               if name.endswith(".weight") and len(shape) == 2
               and check_target_module_exists(config, name.removesuffix(".weight")))


def preset_shapes(family: ModelFamily, size: str = "full") -> tuple[dict, dict[str, tuple[int, ...]]]:
    """A family's preset config and its weights' shapes, from the model built on the meta device (no memory)."""
    from accelerate import init_empty_weights

    config = family.presets.transformer_config(size)
    with init_empty_weights():
        model_class: type[DiffusersTransformer] = family.train.model_class()
        model = model_class.from_config(config)
    assert not isinstance(model, tuple)  # without return_unused_kwargs: the model alone
    return config, {k: tuple(p.shape) for k, p in model.named_parameters()}


def from_preset(family: ModelFamily, size: str = "full") -> Model:
    """A `Model` of a family's preset architecture (`preset_shapes`)."""
    return from_counts(family, *preset_shapes(family, size))


def sample_tokens(family: ModelFamily, height: int, num_frames: int, width: int | None = None) -> int:
    """Tokens one sample runs through the transformer: its latent tokens (`height` high and `width` wide, default
    square) and its text tokens at most."""
    grid = family.pipeline.latent_grid(height, height if width is None else width, num_frames)
    return math.prod(grid) + family.pipeline.max_text_tokens


def _plan(cfg, ranks: int) -> tuple[Model, Setting, float] | None:
    """`cfg`'s plan on `ranks`: the model, the setting, and the GPU's bytes (`--gpu-memory-gib`, else the CUDA
    device's); None where there is none: a CPU run without `--gpu-memory-gib`, or the default checkpoint not made
    yet (the tiny one)."""
    gib = cfg.gpu_memory_gib
    if gib is None and cfg.device.startswith("cuda"):
        import torch

        gib = torch.cuda.get_device_properties(torch.device(cfg.device)).total_memory / GIB
    if gib is None or not (Path(cfg.checkpoint) / "model_index.json").is_file():
        return None
    from ..models import checkpoint_experts
    from .model import LoraSpec
    from .shared_base import why_not

    family = cfg.model_family()
    experts = [e.name for e in checkpoint_experts(cfg.checkpoint, family)]
    models = [from_checkpoint(family, cfg.checkpoint, e) for e in experts]
    m = Model(params=sum(x.params for x in models), trained=sum(x.trained for x in models),
              unit=max(x.unit for x in models), blocks=models[0].blocks, width=models[0].width)
    lora = None
    if cfg.use_lora:
        spec = LoraSpec(cfg.lora_rank, tuple(cfg.lora_target_modules or family.train.lora_targets), cfg.lora_alpha)
        lora = sum(lora_weights(checkpoint_shapes(cfg.checkpoint, e), spec) for e in experts
                   if e in (cfg.lora_experts or experts))
    # With true CFG the train forward runs both branches with gradient (`engine.guidance.guide`): twice the rows
    # hold activations until the backward.
    branches = 2 if cfg.cfg_scale > 1 and family.guidance.branches != "none" else 1
    height, width = cfg.frame_size()
    setting = Setting(rows=cfg.micro_batch_size_sample * cfg.micro_batch_size_tstep * branches,
                      tokens=sample_tokens(family, height, cfg.num_frames, width), optimizer=cfg.optimizer,
                      ema=bool(cfg.ema_decay), ema_offload=cfg.ema_offload,
                      checkpointing=cfg.gradient_checkpointing is True,
                      engine_colocated=not (cfg.engine_url or (cfg.ray and cfg.rollout_gpus)), lora=lora,
                      shared_base=cfg.share_base_weights is not False and why_not(cfg, 1) is None)
    return m, setting, gib * GIB


def check_fits(cfg, ranks: int) -> None:
    """Refuse (ValueError, one line: the numbers and the fix) a setting whose plan exceeds the GPU: a full-parameter
    run, and with `--gradient-checkpointing auto` any run (`auto_checkpointing`). The GPU's size is
    `--gpu-memory-gib`, else the CUDA device's; on a CPU run without it there is no plan."""
    if cfg.gradient_checkpointing == "auto":
        auto_checkpointing(cfg, ranks)
    elif not cfg.use_lora and (plan := _plan(cfg, ranks)) is not None:
        m, setting, gpu = plan
        if peak_bytes(m, setting, ranks) > USABLE * gpu:
            raise _too_big(m, setting, gpu, ranks)


def auto_checkpointing(cfg, ranks: int) -> tuple[int, str]:
    """`--gradient-checkpointing auto`: the fewest first blocks to checkpoint for the plan to fit (0 where it fits
    without, or where there is no plan), and the line that says so; ValueError (one line) where not even every block
    checkpointed fits."""
    plan = _plan(cfg, ranks)
    if plan is None:
        return 0, f"gradient checkpointing auto: no memory plan on {cfg.device} without --gpu-memory-gib; no block " \
                  "recomputed"
    m, setting, gpu = plan
    k = fewest_checkpointed(m, setting, ranks, gpu)
    if k is None:
        raise _too_big(m, replace(setting, checkpointing=True), gpu, ranks)
    need = peak_bytes(m, replace(setting, checkpointed=k), ranks)
    return k, (f"gradient checkpointing auto: {k} of {m.blocks} blocks recomputed in the backward (the plan: "
               f"{need / GIB:.3g} GiB of {USABLE:.0%} of {gpu / GIB:.3g} GiB)")


def _too_big(m: Model, setting: Setting, gpu: float, ranks: int) -> ValueError:
    """The one-line refusal of a setting over the GPU: its numbers and the fixes."""
    need = peak_bytes(m, setting, ranks)
    fits = smallest_ranks(m, setting, gpu)
    fixes = [f"run on {fits} ranks (torchrun --nproc-per-node {fits})" if fits else
             "no number of ranks is enough with the engine on the same GPUs: give it GPUs of its own (--ray "
             "--rollout-gpus)"]
    if not setting.checkpointing:
        fixes.append("--gradient-checkpointing")
    if setting.lora is None and setting.optimizer == "adamw":  # a LoRA's optimizer state is a fraction of a percent
        fixes.append("--optimizer adamw_bf16")
    if setting.lora is None and setting.ema and not setting.ema_offload:
        fixes.append("--ema-offload")
    if setting.rows > 1:
        fixes.append("a smaller --micro-batch-size-sample")
    what = "--no-use-lora" if setting.lora is None else "--gradient-checkpointing auto, every block recomputed"
    trained = f"{m.trained:,} trained" if setting.lora is None else f"a LoRA of {setting.lora:,}"
    return ValueError(f"{what}: {m.params:,} weights ({trained}) need {need / GIB:.3g} GiB per "
                      f"GPU on {ranks} rank(s) at a micro-batch of {setting.rows} x {setting.tokens} tokens, over "
                      f"{USABLE:.0%} of {gpu / GIB:.3g} GiB (docs/training.md, Memory plan); {', or '.join(fixes)}")


def _makes_video(family: ModelFamily, resolution: int, num_frames: int) -> bool:
    try:
        family.pipeline.latent_grid(resolution, resolution, num_frames)
    except ValueError:  # an image family refuses frames
        return False
    return True


def table(micro_batch: int = 1, resolution: int = 1024, num_frames: int = 121, lora_rank: int = 64) -> str:
    """docs/training.md's tables: per family at its full size, the bytes per parameter, the per-GPU state on 8
    ranks, and the fewest H200s at `micro_batch` samples of `resolution`² pixels (`num_frames` for video
    families) with and without activation checkpointing (adamw; adamw_bf16); then, for a LoRA of `lora_rank` on
    one H200, the plan's peak at the fewest blocks `--gradient-checkpointing auto` recomputes, with the engine's
    own copy and with the shared base."""
    from ..models import families
    from .model import LoraSpec

    gpu = H200_GIB * GIB
    lines = ["| family | weights (trained) | bytes/param (adamw; adamw_bf16) | sharded state on 8 ranks | "
             "tokens/sample | H200s, no checkpointing (adamw; adamw_bf16) | H200s, checkpointing (adamw; adamw_bf16) |",
             "|---|---|---|---|---|---|---|"]
    lora_lines = [f"A LoRA of rank {lora_rank} on one H200 at the same micro-batch (`--gradient-checkpointing auto`: "
                  "the plan's peak at the fewest blocks recomputed that fit, and that count):", "",
                  "| family | LoRA weights | engine's own copy: peak (blocks recomputed) | shared base: peak (blocks "
                  "recomputed) |", "|---|---|---|---|"]
    for name, family in sorted(families().items()):
        config, shapes = preset_shapes(family)
        m = from_counts(family, config, shapes)
        frames = num_frames if _makes_video(family, resolution, num_frames) else 1
        tokens = sample_tokens(family, resolution, frames)
        base = Setting(rows=micro_batch, tokens=tokens)
        lean = Setting(rows=micro_batch, tokens=tokens, optimizer="adamw_bf16")
        per_param = [4 + bytes_per_trained_param(s) for s in (base, lean)]
        sharded = (4 * m.params + bytes_per_trained_param(base) * m.trained) / 8 / GIB

        def fewest(ck: bool, m=m, tokens=tokens) -> str:  # this family's, called in this iteration
            return "; ".join(str(smallest_ranks(m, Setting(rows=micro_batch, tokens=tokens, optimizer=o,
                                                           checkpointing=ck), gpu) or "none")
                             for o in ("adamw", "adamw_bf16"))

        size = f"{resolution}²" + (f" × {frames} frames" if frames > 1 else "")
        lines.append(f"| {name} | {m.params / 1e9:.2f}B ({m.trained / 1e9:.2f}B) | {per_param[0]}; {per_param[1]} | "
                     f"{sharded:.1f} GiB | {tokens:,} ({size}) | {fewest(False)} | {fewest(True)} |")
        lora = lora_weights(shapes, LoraSpec(lora_rank, family.train.lora_targets))

        def on_one(shared: bool, m=m, tokens=tokens, lora=lora) -> str:  # this family's, called in this iteration
            s = Setting(rows=micro_batch, tokens=tokens, lora=lora, shared_base=shared)
            k = fewest_checkpointed(m, s, 1, gpu)
            return "does not fit" if k is None else \
                f"{peak_bytes(m, replace(s, checkpointed=k), 1) / GIB:.1f} GiB ({k} of {m.blocks})"

        lora_lines.append(f"| {name} | {lora / 1e6:.0f}M | {on_one(False)} | {on_one(True)} |")
    return "\n".join(lines + [""] + lora_lines)


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """The bytes of every tensor autograd saves for the backward while `forward()` runs: each storage once, the
    model's own weights left out (what the plan's activation term estimates)."""
    import torch  # here: the plan itself is read before torch loads

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(held.values())
