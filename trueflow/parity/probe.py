"""The parity probe: the train-side forward (diffusers + PEFT) and the engine forward on the same seeded
inputs, compared bitwise, with a per-layer report naming the first module that differs. It compares one expert of
the checkpoint (`expert`, default the first), and with `cfg_scale > 1` the guided output of a CFG step as the family
guides it (`engine.guidance.guide`: separate or batched branches, the family's formula) on both sides."""

from __future__ import annotations

import gc
import json
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from .. import loading
from ..dtypes import torch_dtype
from ..engine.guidance import check_guidance, guide
from ..files import publish
from ..engine.weights import build_engine_transformer
from ..models.lora import update_lora
from ..models import checkpoint_experts, family_for_checkpoint, family_for_config, get_family, get_group
from ..models.spec import ModelFamily
from ..train import model as train_model
from .layers import LayerDiff, capture, compare, engine_targets

if TYPE_CHECKING:
    from ..train.model import DiffusersTransformer


@dataclass
class ProbeSpec:
    checkpoint: str | None = None  # a diffusers pipeline folder; or
    random_size: str | None = None  # an in-memory architecture with seeded random weights (tiny|one_block|full)
    batch: int = 1
    text_len: int = 7
    resolution: int = 64
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_b_std: float = 0.02  # B initialised non-zero so the adapter matters from the first forward
    dtype: str = "bf16"
    seed: int = 0
    device: str = "cpu"
    lora_merge_mode: str | None = None  # None: the engine's policy (merged fast, unmerged under the patch group)
    layer_report: str = "all"  # "blocks": top-level modules and whole blocks only (less memory); "none": the output
    family: str | None = None  # where the checkpoint's model_index.json names none (default: the default family)
    batch_invariant: bool = False  # the train side on the mode's backend (its engine: `group:trueflow_batch_invariant`)
    train_micro_batch: int | None = None  # the train side in micro-batches of this many samples (None: one batch)
    expert: str | None = None  # the checkpoint's transformer compared (a pipeline component; default: the first)
    cfg_scale: float = 1.0  # > 1: compare a CFG step's guided output (negative branch: inputs of seed + 1)

    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


@dataclass
class ProbeResult:
    expert: str
    patch_group: str
    disabled_patches: list[str]
    patches_applied: list[str]
    model_output_max_abs_diff: float
    model_output_mean_abs_diff: float
    bitwise_equal: bool
    first_differing_module: str | None
    first_differing_max_abs_diff: float | None
    train_attention_backend: str
    engine_attention_backend: str
    layers: list[LayerDiff] = field(default_factory=list)

    def to_json(self, with_layers: bool = True) -> dict:
        d = asdict(self)
        if not with_layers:
            d.pop("layers")
        return d


class ParityProbe:
    """Builds the train side and its output once; `run(group, disabled)` builds an engine and compares."""

    def __init__(self, spec: ProbeSpec):
        if (spec.checkpoint is None) == (spec.random_size is None):
            raise ValueError("give exactly one of a checkpoint folder or a random in-memory size")
        self.spec = s = spec
        if s.checkpoint is not None:
            self.family = family_for_checkpoint(s.checkpoint, s.family)
        else:
            self.family = get_family(s.family) if s.family is not None else family_for_config({})
        granule = self.family.pipeline.pixels_per_token
        if s.resolution % granule:
            raise ValueError(f"--resolution {s.resolution} must be a multiple of {granule} pixels")
        dtype, device = s.torch_dtype(), torch.device(s.device)
        experts = [e.name for e in checkpoint_experts(s.checkpoint, self.family)] if s.checkpoint else ["transformer"]
        self.expert = s.expert or experts[0]
        if self.expert not in experts:
            raise ValueError(f"--expert {self.expert}: not an expert of "
                             f"{s.checkpoint or f'--random-size {s.random_size}'} (its experts: {', '.join(experts)})")
        check_guidance(self.family.name, self.family.guidance, s.cfg_scale, None, None)
        # The train side runs on its compute copy: fp32 values cast once to the compute dtype (docs/precision.md).
        if s.checkpoint is not None:
            self.config = loading.read_transformer_config(s.checkpoint, self.expert)
            self.state_dict = loading.read_transformer_state_dict(s.checkpoint, subfolder=self.expert)
            self.train = train_model.load_transformer(self.family, s.checkpoint, dtype, self.expert)
        else:
            assert s.random_size is not None  # one of checkpoint / random_size (checked above)
            self.config = self.family.presets.transformer_config(s.random_size)
            # the family's diffusers transformer (the spec, engine-side, does not name diffusers' types)
            built = self.family.presets.build_transformer(self.config, seed=s.seed, dtype=dtype, device=device)
            self.train = cast("DiffusersTransformer", built)
            self.state_dict = self.train.state_dict()
        self.train.to(device).eval().requires_grad_(False)
        self.lora = None
        if s.lora_rank:
            spec_l = train_model.LoraSpec(rank=s.lora_rank, alpha=s.lora_alpha,
                                          target_modules=self.family.train.lora_targets)
            train_model.add_lora(self.train, spec_l, b_init_std=s.lora_b_std, seed=s.seed + 1)
            self.lora = (train_model.lora_state_dict(self.train), spec_l.scale)
        self.inputs = self.family.probe_inputs(self.config, s.batch, s.text_len, s.resolution, dtype, s.seed, device)
        # With CFG, the negative branch's inputs: another seed's conditioning, the positive's distilled scale (the
        # engine passes both branches one scale).
        distilled = self.family.guidance.distilled_input
        self.negative_cond = None if s.cfg_scale <= 1 else {
            **self.family.probe_inputs(self.config, s.batch, s.text_len, s.resolution, dtype, s.seed + 1,
                                       device)["cond"],
            **({distilled: self.inputs["cond"][distilled]} if distilled else {})}
        if s.train_micro_batch is not None and s.train_micro_batch < 1:
            raise ValueError(f"--train-micro-batch must be >= 1, got {s.train_micro_batch}")
        if s.batch_invariant:
            from ..train.batch_invariant import register_backend

            self.train_backend = register_backend()
        else:
            self.train_backend = self.family.train.backend(dtype)
        self._train_forward()

    def set_inputs(self, inputs: dict) -> None:
        """Compare on other inputs (the family's `probe_inputs` layout: hidden_states, timestep, grid, cond), e.g. a
        non-square video; the train forward is re-run on them."""
        self.inputs = inputs
        self._train_forward()

    def _guided(self, forward, timestep: torch.Tensor) -> torch.Tensor:
        """`forward(hidden_states, timestep, cond)` on the probe's inputs; with CFG, the family's guided step."""
        i = self.inputs
        return guide(self.family.guidance, forward, i["hidden_states"], timestep, i["cond"], self.negative_cond,
                     self.spec.cfg_scale, self.family.pipeline.text_streams).output

    def _train_forward(self) -> None:
        names = {n: [(n, None)] for n in _report_names(self.family, self.config, self.spec.layer_report)}
        train, grid = self.family.train, self.inputs["grid"]

        def forward(x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
            # in micro-batches of `train_micro_batch` rows (the capture joins their layers' outputs)
            return torch.cat([train_model.train_forward(self.family, self.train, x[r], t[r], grid, _rows(cond, r),
                                                        backend=self.train_backend)
                              for r in _chunks(x.shape[0], self.spec.train_micro_batch or x.shape[0])])

        with torch.no_grad(), capture(self.train, names) as seen:
            self.train_output = self._guided(forward, train.timestep(self.inputs["timestep"], self.spec.torch_dtype()))
        self.train_layers = dict(seen)

    def build_engine(self, patch_group: str, disabled=()):
        s = self.spec
        engine = build_engine_transformer(self.config, self.state_dict, s.device, s.torch_dtype(), patch_group,
                                          disabled, family=self.family.name)
        if self.lora is not None:
            update_lora(engine, self.lora[0], self.lora[1], s.lora_merge_mode)
        return engine

    @torch.no_grad()
    def step_lora(self, engine, seed: int, std: float = 1e-3) -> None:
        """A stand-in optimizer step: seeded noise on the train side's LoRA, then the same weight update pushed
        to `engine` (PEFT-format tensors, as weight sync sends them). The train forward is re-run."""
        if self.lora is None:
            raise ValueError("step_lora needs a probe with a LoRA (lora_rank > 0)")
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.train.named_parameters()):
            if ".lora_" in name:
                p.add_((torch.randn(p.shape, generator=g) * std).to(p.device, p.dtype))
        self.lora = (train_model.lora_state_dict(self.train), self.lora[1])
        self._train_forward()
        update_lora(engine, self.lora[0], self.lora[1], self.spec.lora_merge_mode)

    def run(self, patch_group: str = "none", disabled=()) -> tuple[ProbeResult, torch.Tensor]:
        engine = self.build_engine(patch_group, disabled)
        result, out = self.compare_engine(engine, patch_group, disabled)
        alive = weakref.ref(engine)
        del engine
        if alive() is not None:  # kept by a reference cycle: free it before the next engine is built. A full
            gc.collect()         # collection costs ~0.5 s in a test process, 12 times per --ablate
        return result, out

    def compare_engine(self, engine, patch_group: str, disabled=()) -> tuple[ProbeResult, torch.Tensor]:
        with torch.no_grad(), capture(engine, engine_targets(engine, self.family, self.spec.layer_report)) as seen:
            grid = self.inputs["grid"]
            out = self._guided(lambda x, t, cond: engine(hidden_states=x, timestep=t, grid=grid, **cond),
                               self.inputs["timestep"])
        rows = compare(self.train_layers, seen)
        first = next((r for r in rows if r.max_abs_diff > 0), None)
        d = (out.float() - self.train_output.float()).abs()
        return ProbeResult(
            expert=self.expert, patch_group=patch_group, disabled_patches=list(disabled),
            patches_applied=list(engine.patches_applied),
            model_output_max_abs_diff=d.max().item(), model_output_mean_abs_diff=d.mean().item(),
            bitwise_equal=torch.equal(out, self.train_output),
            first_differing_module=first.module if first else None,
            first_differing_max_abs_diff=first.max_abs_diff if first else None,
            train_attention_backend=self.train_backend,
            engine_attention_backend=self.family.engine.attention_backend(engine),
            layers=rows), out

    def ablate(self, patch_group: str) -> list[ProbeResult]:
        """The whole group, then each patch switched off alone, then no group."""
        group = get_group(patch_group)
        if group is None:
            example = next(iter(self.family.patch_groups))
            raise ValueError(f"--ablate needs a patch group (e.g. --patch-group {example})")
        runs = [(patch_group, ())] + [(patch_group, (p,)) for p in group.patch_names] + [("none", ())]
        return [self.run(g, d)[0] for g, d in runs]

    def save(self, out_dir: str | Path, result: ProbeResult, engine_output: torch.Tensor) -> Path:
        """Inputs, engine output, the LoRA (PEFT format) and a manifest: what an outside script needs to rerun
        the train side with diffusers + PEFT alone (docs/parity-probe.md)."""
        from safetensors.torch import save_file

        s = self.spec
        if self.negative_cond is not None:
            raise ValueError("--output-dir writes the inputs of one forward: drop --cfg-scale")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # The conditioning under its model-input names, beside hidden_states and timestep (no key clashes: they
        # are the transformer's keyword arguments).
        # Each its own copy: safetensors refuses tensors that share storage, and a family whose train side takes
        # the timestep as it is (LTX-2.3: fp32 in, fp32 out) gives back the very `timestep` tensor.
        tensors = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format)
                   for k, v in {**self.inputs, **self.inputs["cond"]}.items() if isinstance(v, torch.Tensor)}
        tensors["timestep_train"] = self.family.train.timestep(self.inputs["timestep"], s.torch_dtype()).cpu().clone()
        tensors["engine_output"] = engine_output.contiguous().cpu()
        save_file(tensors, str(out / "inputs.safetensors"))
        files = ["inputs.safetensors"]
        if self.lora is not None:
            save_file({k: v.contiguous().cpu() for k, v in self.lora[0].items()}, str(out / "lora.safetensors"))
            files.append("lora.safetensors")
        manifest = {
            "format": "trueflow-parity-probe/2",
            "checkpoint": str(Path(s.checkpoint).resolve()) if s.checkpoint else None,
            "family": self.family.name, "expert": self.expert, "random_size": s.random_size, "seed": s.seed,
            "dtype": s.dtype, "grid": list(self.inputs["grid"]),
            "train_attention_backend": self.train_backend,
            "lora": None if self.lora is None else {
                "rank": s.lora_rank, "alpha": s.lora_alpha if s.lora_alpha is not None else s.lora_rank,
                "target_modules": list(self.family.train.lora_targets), "file": "lora.safetensors"},
            "files": files,
            "result": result.to_json(with_layers=False),
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        publish(*(out / f for f in files))  # safetensors writes 0600
        return out


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def _rows(cond: dict, rows: slice) -> dict:
    """A micro-batch's conditioning: every batched entry's rows (a stream keeps the batch's padding and mask)."""
    return {k: None if v is None else v[rows] for k, v in cond.items()}


def _report_names(family: ModelFamily, config: dict, layer_report: str) -> list[str]:
    """The diffusers module names the engine can be compared on (from a parameter-free meta-device engine)."""
    engine = family.engine.build_model(config, device="meta")
    return [name for targets in engine_targets(engine, family, layer_report).values() for name, _ in targets]


def make_inputs(config: dict, batch: int, text_len: int, resolution: int, dtype, seed: int, device,
                family: str | None = None) -> dict:
    """The probe's seeded inputs for a transformer config (its family from the config, or `family`): packed
    latents, text embeddings, and one schedule timestep (fp32, 0..1000) shared by the batch, as a denoising step
    has. The engine takes it as is; the train side as its pipeline passes it (`TrainSide.timestep`)."""
    return family_for_config(dict(config), family).probe_inputs(config, batch, text_len, resolution, dtype, seed,
                                                                device)
