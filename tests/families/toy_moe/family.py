"""`toy_moe`: the toy DiT of `toy_dit` as a pipeline of two experts with batched CFG and a distilled guidance input,
so the generic code runs each of them before a real family needs it (Wan2.2-A14B's experts, SD3.5's batched CFG,
FLUX.1-dev's distilled guidance).

It differs from `toy_dit` only where those features need it; everything else is toy_dit's code:
- two transformers, `transformer/` and `transformer_2/` (each seeded apart), named in model_index.json with a
  `boundary_ratio`, switched as WanPipeline switches them (`spec.boundary_experts`: `transformer` for
  t >= 0.6·1000, `transformer_2` below);
- CFG as StableDiffusion3Pipeline runs it: one forward of `[negative, positive]` rows, the plain formula;
- prompts embedded at a fixed length with no mask (as SD3's CLIP/T5 embeddings), so the two halves of the batched
  forward have one width;
- a distilled guidance input `guidance` (`[B]` fp32, FluxPipeline's `full([1], g).expand(B)`), default scale 3.5;
- one timestep per sample (`[T]` in the schedule, `[B]` into the model), as SD3 and Wan2.2-A14B have.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import diffusers
import torch

from trueflow.models.cfg import plain_cfg
from trueflow.models.spec import Guidance, PatchGroupSpec, Presets, boundary_experts

from ..toy_dit import family as toy

BOUNDARY_RATIO = 0.6
TEXT_TOKENS = 6  # every prompt's embedding length (byte 0 pads, as a fixed-length encoder's pad tokens)
DISTILLED_DEFAULT = 3.5  # FluxPipeline's guidance_scale default
SCHEDULER_CONFIG = dict(toy.SCHEDULER_CONFIG)
SIZES = {"tiny": {**toy.SIZES["tiny"], "guidance_embeds": True}}
EXPERTS = ("transformer", "transformer_2")


class ToyMoEDiTModel(toy.ToyDiT2DModel):
    """Its own class name, so a transformer config names one family."""


class ToyMoEPipeline(toy.ToyDiTPipeline):
    """Only what the trainer's checkpoints call (each expert's LoRA is written as one transformer's)."""


def transformer_config(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown transformer size {size!r}; known sizes: {', '.join(SIZES)}")
    return dict(SIZES[size])


def build_transformer(size_or_config, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    config = transformer_config(size_or_config) if isinstance(size_or_config, str) else size_or_config
    return toy.build_transformer(config, seed, dtype, device, cls=ToyMoEDiTModel)


def write_checkpoint(out: Path, size: str, seed: int, dtype: torch.dtype, device) -> None:
    for k, name in enumerate(EXPERTS):  # two experts of one architecture, each with its own weights
        build_transformer(size, seed + k, dtype, device).save_pretrained(out / name, safe_serialization=True)
    (out / "scheduler").mkdir()
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG))
    component = [__name__, "ToyMoEDiTModel"]
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "ToyMoEPipeline", "_diffusers_version": diffusers.__version__, "boundary_ratio": BOUNDARY_RATIO,
        "transformer": component, "transformer_2": component}))


def encode_prompts(tokenizer, text_encoder, prompts: list[str], max_len: int) -> list[dict]:
    width = min(TEXT_TOKENS, max_len)
    device = text_encoder.weight.device
    ids = [(list(p.encode()) + [0] * width)[:width] for p in prompts]
    return [{"context": text_encoder(torch.tensor(i, device=device))} for i in ids]


def schedule(config: dict, steps: int, tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    sigmas, _ = toy.schedule(config, steps, tokens, device)
    return sigmas, sigmas[:-1] * 1000  # [T]: one timestep per sample


def probe_inputs(config: dict, batch: int, text_len: int, resolution: int, dtype, seed: int, device) -> dict:
    inputs = toy.probe_inputs(config, batch, text_len, resolution, dtype, seed, device)
    g = torch.Generator().manual_seed(seed + 7)
    return {**inputs, "timestep": inputs["timestep"][:, 0].contiguous(),
            "cond": {**inputs["cond"], "guidance": (1 + 4 * torch.rand(batch, generator=g)).to(device)}}


FAMILY = replace(
    toy.FAMILY,
    name="toy_moe",
    pipeline_class="ToyMoEPipeline",
    pipeline_module=__name__,
    patch_groups={"toy_moe": PatchGroupSpec(toy.make_group(name="toy_moe"), lambda b: toy.make_group(b, "toy_moe"),
                                            {"native": "sdpa"})},
    pipeline=replace(toy.FAMILY.pipeline, encode_prompts=encode_prompts, schedule=schedule,
                     scheduler_config=SCHEDULER_CONFIG),
    probe_inputs=probe_inputs,
    train=replace(toy.FAMILY.train, transformer_class="ToyMoEDiTModel", module=__name__),
    presets=Presets(transformer_config=transformer_config, build_transformer=build_transformer,
                    write_checkpoint=write_checkpoint),
    guidance=Guidance("batched", plain_cfg, distilled_input="guidance", distilled_default=DISTILLED_DEFAULT,
                      per_expert_scale=True),
    experts=boundary_experts,
)
