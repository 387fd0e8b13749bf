"""One whole GRPO step on one GPU: `trueflow train` against a flow_grpo-style loop on diffusers + PEFT, same work.

    python benchmarks/grpo_step.py --out grpo_step.json [--resolution 512|1024] [--rollouts 3] [--size full|tiny]
    python benchmarks/grpo_step.py --family ltx2 --out grpo_step_ltx.json     # LTX-2.3, 768x512, 33 frames

Recipe (flow-GRPO-like, both loops): the family's full-size transformer (seeded random bf16 weights, in a
checkpoint folder written as `scripts/aligned_run.py` writes it), `--prompts` prompts per step x a group of 8
samples, 10 steps with a 2-step SDE window (noise level 1.2), LoRA rank 64 on the family's attention + MLP targets,
a PickScore reward on a random CLIP of ViT-H/14's size (vision 1280 wide x 32 layers, text 1024 x 24, projection
1024, fp32; written in the PickScore folder layout as `rewards/tiny_clip.py` does), group-normalised advantages,
PPO-clip on the window's steps (with CFG in training where there is CFG), AdamW, one optimizer step per rollout,
gradient checkpointing, text padded or cut to 512 tokens. The families (`--family`, one code path; `QwenImage` and
`LTX2` below hold what differs):
- `qwen_image` (default): images of `--resolution`² (512 or 1024), true CFG 4 (two branch forwards), `_native_flash`
  attention on both sides, patch group `qwen_image`.
- `ltx2`: LTX-2.3 videos of `--width` x `--resolution` x `--num-frames` (768 x 512 x 33: 1920 tokens a sample), run
  unguided as its GRPO recipe runs (one forward a step), the modality-isolated video prediction the family trains
  (`trueflow/models/ltx2/train.py`) in both loops, the `native` attention backend on both sides (the connectors'
  mask is an additive bias, which `_native_flash` refuses), patch group `ltx`, PickScore on 3 evenly spread frames
  of each video, averaged (the trainer's `--reward-frames`).

- `trueflow`: `trueflow.train.run.run_training` (embedded placement: engine, trainer and reward in this process;
  or `--engine-process`), the family's patch group, microgroup = micro-batch. Phase times are the run's own
  metrics.jsonl fields (`time_rollout`, `time_reward`, `time_train`, `time_sync`); a step's wall time is the
  interval between two metrics lines. Peak memory per phase comes from wrapping the trainer's phase methods for
  the run (a method that is not found is listed under `trueflow_hooks_missing` and its phase's peak is null).
- `baseline`: flow_grpo's loop (github.com/yifan123/flow_grpo, scripts/train_qwenimage_edit_plus.py, the Qwen-Image
  one): the family pipeline's components (`QwenImagePipeline`, `LTX2Pipeline`: their own encode, prepare_latents,
  schedule and decode calls) sampling with the flow-GRPO SDE step (`engine.samplers.sde_step`) inside the window
  and the Euler step elsewhere, old log-probs from that sampling pass, the same prompts and batches, PEFT
  `get_peft_model` (fp32 LoRA weights, PEFT's default) under `torch.autocast(bf16)` as flow_grpo runs its forwards,
  AdamW. One model samples and trains, so it has no sync phase. Differences from flow_grpo: the two CFG branches
  are two forwards (flow_grpo batches them with a padded text mask, which `_native_flash` refuses; QwenImagePipeline
  runs two forwards), alpha = rank and trueflow's lr (the same work as trueflow's), and the reward is scored after
  sampling (flow_grpo overlaps it with its next sampling batch in a thread). flow_grpo has no LTX-2 loop: the
  `ltx2` baseline is the same loop on LTX2Pipeline's calls.

Both loops run `--rollouts` steps; the first is a warm-up (CUDA graph capture, kernel selection) and is left out
of the summary. Images/GPU/s = samples (images, or videos) per step / the step's wall time. TFLOP/s per phase = the
FLOPs of the forwards the phase runs over its time (transformer GEMMs + attention: Qwen-Image by
`rollout_vs_diffusers.step_flops` at each branch's real text length, LTX-2.3 by PyTorch's `FlopCounterMode` over a
meta-device forward; the reward's CLIP towers as `clip_flops` counts them): rollout = steps x branches x samples
forwards; train = SDE steps x branches x samples x 3 (forward + backward at 2x), the recomputation of gradient
checkpointing not counted; reward = one CLIP forward per image (per scored frame of a video). Text encoding and
VAE decoding (small here) are not counted. On a GPU each loop's summary also gives the time those FLOPs take at the
GEMM ceiling measured in the run (an 8192³ bf16 matmul): what bounds the step. The loops run one after the other
(both models do not fit together); the JSON is rewritten after every phase, so a run cut short keeps what it
measured. Published peer figures are printed for context.

`--size tiny` runs both loops on the CPU with the tiny transformer and a tiny CLIP (a smoke test: timings are
meaningless).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

BF16 = torch.bfloat16
GROUP, STEPS, SDE_STEPS, NOISE_LEVEL, LORA_RANK = 8, 10, 2, 1.2, 64
NEGATIVE_PROMPT = " "  # the trainer's default negative prompt, and flow_grpo's
MAX_SEQUENCE_LENGTH = 512  # the trainer's default --max-sequence-length: LTX2Pipeline pads every prompt to it
REWARD_FRAMES = 3  # a video's reward: PickScore on this many evenly spread frames, averaged (the trainer's default)
PHASES = ("rollout", "reward", "train", "sync")
PROMPTS = (  # PickScore-style prompts, cycled as `trueflow train` cycles its prompt file
    "a red fox curled up asleep in fresh snow, soft morning light",
    "a lighthouse on a rocky coast at dusk, waves crashing below",
    "a bowl of ripe cherries on a wooden table, studio photo",
    "a vintage red sports car parked in front of a glass building",
    "a watercolor painting of a garden full of roses and tulips",
    "a cup of coffee with latte art next to a croissant",
)
PEERS = {  # published figures (other settings, real weights): context, not a like-for-like comparison
    "qwen_image": (
        {"name": "verl-omni Qwen-Image FlowGRPO, LoRA", "hardware": "4x H800", "images_per_gpu_s": 0.305},
        {"name": "verl-omni Qwen-Image FlowGRPO, full-parameter, no CFG", "hardware": "4x H200",
         "images_per_gpu_s": 0.51}),
    # miles_diffusion's LTX-2.3 GRPO recipe (trueflow/models/ltx2/presets.py: 8 prompts x 8 videos of 57 frames at
    # 768x512, 24 steps) takes 252 s a step (87.6 s of it rolling out) on 5 H200s: 64 / 252 / 5 videos/GPU/s.
    "ltx2": (
        {"name": "miles_diffusion LTX-2.3 GRPO (57 frames 768x512, 24 steps, 64 videos a step)", "hardware": "5x H200",
         "images_per_gpu_s": round(64 / 252 / 5, 4)},),
}
GOAL_SPEEDUP = {"qwen_image": 2.0}  # issue Q.5: trueflow >= 2x the baseline's images/GPU/s (Qwen-Image, at 1024²)


class UsageError(Exception):
    """A bad argument: reported as one line, exit 2."""


class Size(NamedTuple):
    height: int
    width: int
    frames: int  # 1: images


# -- the families: what differs between them (the pipeline's calls, the FLOP count); the loops are shared ------------
class QwenImage:
    """Qwen-Image: true CFG 4 (two branch forwards), `_native_flash` on both sides, images."""

    name, pipeline_class, patch_group = "qwen_image", "QwenImagePipeline", "qwen_image"
    attention_backend, cfg, negative_prompt, granule = "_native_flash", 4.0, NEGATIVE_PROMPT, 16
    full_sizes = (Size(512, 512, 1), Size(1024, 1024, 1))

    def default_size(self, resolution: int) -> Size:
        return Size(resolution, resolution, 1)

    def text_lengths(self, ckpt: Path) -> dict[str, int]:
        """Each prompt's (and the negative prompt's) text length as the pipeline encodes it."""
        from diffusers import QwenImagePipeline

        pipe = QwenImagePipeline.from_pretrained(ckpt, transformer=None, vae=None)
        with torch.no_grad():
            return {p: pipe.encode_prompt(prompt=[p], device="cpu")[0].shape[1] for p in (*PROMPTS, NEGATIVE_PROMPT)}

    def forward_flops(self, config: dict, size: Size, batch: int, text_len: int) -> float:
        """GEMM + attention FLOPs of one transformer forward: half of `rollout_vs_diffusers.step_flops`, which
        counts the two forwards of a guided step."""
        import rollout_vs_diffusers as rvd

        return rvd.step_flops(config, size.height, batch, text_len) / 2

    # flow_grpo's loop (scripts/train_qwenimage_edit_plus.py) on QwenImagePipeline's calls
    def prepare(self, pipe) -> None:
        pipe.vae.to(dtype=torch.float32)  # flow_grpo decodes in fp32

    def encode(self, pipe, prompt: str, n: int, device: str) -> dict:
        embeds, mask = pipe.encode_prompt(prompt=[prompt], device=device, num_images_per_prompt=n)
        return {"embeds": embeds, "mask": mask}

    def latents(self, pipe, size: Size, n: int, generators: list, device: str) -> torch.Tensor:
        return pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, size.height, size.width, BF16,
                                    device, generators)

    def forward(self, model, x: torch.Tensor, t: torch.Tensor, cond: dict, size: Size) -> torch.Tensor:
        """One forward as QwenImagePipeline calls it (timestep = t in the latent dtype / 1000)."""
        shapes = [[(1, size.height // 16, size.width // 16)]] * x.shape[0]
        return model(hidden_states=x, timestep=t.expand(x.shape[0]).to(x.dtype) / 1000,
                     encoder_hidden_states=cond["embeds"], encoder_hidden_states_mask=cond["mask"],
                     img_shapes=shapes, return_dict=False)[0]

    def decode(self, pipe, x: torch.Tensor, size: Size) -> torch.Tensor:
        """uint8 images [N, H, W, 3] on the CPU, as QwenImagePipeline decodes them."""
        latents = pipe._unpack_latents(x, size.height, size.width, pipe.vae_scale_factor).to(pipe.vae.dtype)
        z = pipe.vae.config.z_dim
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents)
        inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1).to(latents)
        image = pipe.vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        image = pipe.image_processor.postprocess(image, output_type="pt")
        return (image * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu()


class LTX2:
    """LTX-2.3 text-to-video: unguided (one forward a step, `cfg_scale` 1 as its GRPO recipe runs), the `native`
    backend on both sides (the connectors' mask, made an additive bias, is refused by `_native_flash`), the
    modality-isolated video prediction the family trains (`trueflow/models/ltx2/train.py`) in both loops, videos."""

    name, pipeline_class, patch_group = "ltx2", "LTX2Pipeline", "ltx"
    attention_backend, cfg, negative_prompt, granule = "native", 1.0, None, 32
    full_sizes = (Size(512, 768, 33),)

    def default_size(self, resolution: int) -> Size:
        return Size(resolution, resolution * 3 // 2, 33)  # the recipe's 3:2 landscape (768x512 at 512)

    def text_lengths(self, ckpt: Path) -> dict[str, int]:
        """LTX2Pipeline pads every prompt to max_sequence_length, and its connectors fill the padding with registers:
        every prompt is that long."""
        return dict.fromkeys(PROMPTS, MAX_SEQUENCE_LENGTH)

    def __init__(self):
        self._flops: dict[tuple, int] = {}

    def forward_flops(self, config: dict, size: Size, batch: int, text_len: int) -> float:
        """GEMM + attention FLOPs of one transformer forward, counted by PyTorch's `FlopCounterMode` over the engine
        model's forward on the meta device (no memory, no kernels) for one sample (the count is linear in the
        batch), once per shape: the isolated video stream, which is diffusers' work but for its one-token audio
        stream."""
        key = (size, text_len)
        if key not in self._flops:
            self._flops[key] = _ltx2_sample_flops(config, size, text_len)
        return batch * self._flops[key]

    # the loop on LTX2Pipeline's calls
    def prepare(self, pipe) -> None:
        pass  # the pipeline decodes in its own dtype

    def encode(self, pipe, prompt: str, n: int, device: str) -> dict:
        embeds, mask, _, _ = pipe.encode_prompt(prompt=[prompt], do_classifier_free_guidance=False,
                                                num_videos_per_prompt=n, max_sequence_length=MAX_SEQUENCE_LENGTH,
                                                device=device)
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
        return {"encoder_hidden_states": video, "audio_encoder_hidden_states": audio,
                "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask}

    def latents(self, pipe, size: Size, n: int, generators: list, device: str) -> torch.Tensor:
        """Packed fp32 latents [n, S, C]: the pipeline keeps them fp32 through its loop."""
        return pipe.prepare_latents(n, pipe.transformer.config.in_channels, size.height, size.width, size.frames, 0.0,
                                    torch.float32, device, generators)

    def forward(self, model, x: torch.Tensor, t: torch.Tensor, cond: dict, size: Size) -> torch.Tensor:
        """The pipeline's call (latents cast to the embeddings' dtype, timestep = sigma = t in fp32), with the
        modalities isolated: `trueflow.models.ltx2.train.train_forward`, the call the family trains."""
        from trueflow.models.ltx2.latents import latent_grid
        from trueflow.models.ltx2.train import train_forward

        grid = latent_grid(size.height, size.width, size.frames)
        return train_forward(model, x.to(cond["encoder_hidden_states"].dtype), t.expand(x.shape[0]).float(), grid,
                             cond)

    def decode(self, pipe, x: torch.Tensor, size: Size) -> torch.Tensor:
        """uint8 videos [N, F, H, W, 3] on the CPU, as LTX2Pipeline decodes them (2.3's VAE: no decode timestep)."""
        from trueflow.models.ltx2.latents import latent_grid

        grid = latent_grid(size.height, size.width, size.frames)
        latents = pipe._unpack_latents(x, *grid, pipe.transformer_spatial_patch_size,
                                       pipe.transformer_temporal_patch_size).to(BF16)
        latents = pipe._denormalize_latents(latents, pipe.vae.latents_mean, pipe.vae.latents_std,
                                            pipe.vae.config.scaling_factor).to(pipe.vae.dtype)
        video = pipe.vae.decode(latents, None, return_dict=False)[0]
        video = pipe.video_processor.postprocess_video(video, output_type="pt")  # [N, F, 3, H, W] in 0..1
        return (video * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 1, 3, 4, 2).cpu()


def _ltx2_sample_flops(cfg: dict, size: Size, text_len: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    from trueflow.models import get_family
    from trueflow.models.ltx2.latents import latent_grid

    grid = latent_grid(size.height, size.width, size.frames)
    model = get_family("ltx2").engine.build_model(cfg, device="meta")
    with torch.device("meta"):
        inputs = {"hidden_states": torch.empty(1, math.prod(grid), cfg["in_channels"], dtype=BF16),
                  "timestep": torch.empty(1), "grid": grid,
                  "encoder_hidden_states": torch.empty(1, text_len, cfg["cross_attention_dim"], dtype=BF16)}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**inputs)
    return counter.get_total_flops()


FAMILIES = {f.name: f for f in (QwenImage(), LTX2())}


# -- setup: checkpoint, reward model, prompts ----------------------------------------------------------------------
def write_checkpoint(path: Path, family: str, size: str, device: str) -> Path:
    """The family's pipeline folder (reused if already there), as scripts/aligned_run.py writes it: the full size is
    drawn on the device in bf16 (40 GB), the tiny one on the CPU in fp32."""
    if not (path / "model_index.json").is_file():
        from trueflow.checkpoints import init_checkpoint

        full = size == "full"
        init_checkpoint(path, family=family, size=size, overwrite=True, dtype=BF16 if full else torch.float32,
                        device=device if full else "cpu")
    return path


def write_reward_model(path: Path, size: str, device: str) -> Path:
    """A PickScore-layout folder (CLIPModel + CLIPProcessor): the tiny random CLIP, or at full size a random CLIP of
    ViT-H/14's size with the same processor at 224 px (fp32, as PickScore runs)."""
    if (path / "config.json").is_file():
        return path
    from trueflow.rewards.tiny_clip import init_clip_h, init_tiny_clip

    return init_tiny_clip(path) if size != "full" else init_clip_h(path, device)


def rollout_prompts(index: int, per_step: int) -> list[str]:
    """The prompts of rollout `index`, chosen as `trueflow train` chooses them from its prompt file."""
    return [PROMPTS[(index * per_step + i) % len(PROMPTS)] for i in range(per_step)]


# -- FLOPs ------------------------------------------------------------------------------------------------------------
def clip_flops(config: dict, n_images: int, text_len: int) -> float:
    """FLOPs of scoring `n_images` (one image and one text each) with a CLIPModel: the same per-layer count as the
    transformer's (q/k/v/out + MLP on every token, QK^T and PV), the patch embedding and both projections."""
    v, t, proj = config["vision_config"], config["text_config"], config["projection_dim"]

    def tower(c: dict, tokens: int) -> int:
        d = c["hidden_size"]
        return c["num_hidden_layers"] * (tokens * (4 * d * d + 2 * d * c["intermediate_size"]) + 2 * tokens**2 * d)

    patches = (v["image_size"] // v["patch_size"]) ** 2
    vision = tower(v, patches + 1) + patches * 3 * v["patch_size"] ** 2 * v["hidden_size"] + v["hidden_size"] * proj
    text = tower(t, text_len) + t["hidden_size"] * proj
    return 2 * n_images * (vision + text)


class FlopCounter:
    """The FLOPs of each phase of one step (the same work in both loops)."""

    def __init__(self, args: argparse.Namespace, config: dict, clip_dir: Path, text_lens: dict[str, int]):
        from transformers import CLIPTokenizer

        self.args, self.config, self.text_lens = args, config, text_lens
        self.clip_config = json.loads((clip_dir / "config.json").read_text())
        self.clip_tokenizer = CLIPTokenizer.from_pretrained(clip_dir)

    def step(self, prompts: list[str]) -> dict[str, float | None]:
        family, size = self.args.family, self.args.sample_size
        # the branches of a step: the prompt's, and with true CFG the negative prompt's
        branches = [[p] + ([NEGATIVE_PROMPT] if family.cfg > 1 else []) for p in prompts]
        both = sum(family.forward_flops(self.config, size, GROUP, self.text_lens[b]) for bs in branches for b in bs)
        # PickScore's processor pads the batch's texts to the longest, at most 77 tokens; a video scores
        # REWARD_FRAMES frames of each sample.
        clip_text = min(77, max(len(self.clip_tokenizer(p).input_ids) for p in prompts))
        frames = REWARD_FRAMES if size.frames > 1 else 1
        return {"rollout": STEPS * both,
                "reward": clip_flops(self.clip_config, GROUP * len(prompts) * frames, clip_text),
                "train": SDE_STEPS * 3 * both, "sync": None}


# -- results ----------------------------------------------------------------------------------------------------------
class Results:
    def __init__(self, out: Path, info: dict, family: str):
        self.out, self.info, self.rows, self.family = out, info, [], family
        self.flops: FlopCounter | None = None

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        return row

    def complete(self, row: dict) -> None:
        """Derived fields of a finished step: its images/GPU/s and each phase's TFLOP/s."""
        row["images_per_gpu_s"] = row["images"] / row["step_s"] if row.get("step_s") else None
        flops = self.flops.step(row["prompts"]) if self.flops else {}
        for phase in PHASES:
            f, t = flops.get(phase), row.get(f"time_{phase}")
            row[f"flops_{phase}"] = f
            row[f"tflops_{phase}"] = f / t / 1e12 if f and t else None

    def summary(self) -> dict:
        out = {}
        for loop in ("trueflow", "baseline"):
            rows = [r for r in self.rows if r["loop"] == loop and not r["warmup"] and r.get("step_s")]
            if not rows:
                continue
            s = {"measured_steps": len(rows), "images_per_step": rows[0]["images"]}
            for key in ("step_s", *(f"time_{p}" for p in PHASES)):
                s[key] = statistics.median(r[key] for r in rows)
            s["images_per_gpu_s"] = s["images_per_step"] / s["step_s"]
            for phase in PHASES:
                values = [r[f"tflops_{phase}"] for r in rows if r.get(f"tflops_{phase}") is not None]
                s[f"tflops_{phase}"] = statistics.median(values) if values else None
                peaks = [r[f"peak_gib_{phase}"] for r in rows if r.get(f"peak_gib_{phase}") is not None]
                s[f"peak_gib_{phase}"] = max(peaks) if peaks else None
            # What bounds the step: its phases' FLOPs at the GEMM ceiling measured in this run.
            flops = rows[0]
            ceiling = self.info.get("gemm_tflops")
            if ceiling:
                s["floor_at_gemm_ceiling_s"] = sum(flops[f"flops_{p}"] or 0 for p in PHASES) / (ceiling * 1e12)
            out[loop] = s
        if "trueflow" in out and "baseline" in out:
            speedup = out["trueflow"]["images_per_gpu_s"] / out["baseline"]["images_per_gpu_s"]
            out["speedup_images_per_gpu_s"] = speedup
            if self.family in GOAL_SPEEDUP:
                out["goal_2x_met"] = speedup >= GOAL_SPEEDUP[self.family]
        return out

    def save(self) -> None:
        self.out.write_text(json.dumps({"info": self.info, "rows": self.rows, "summary": self.summary(),
                                        "peers": PEERS[self.family]}, indent=1))


def peak_gib(cuda: bool) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if cuda else None


def reset_peak(cuda: bool) -> None:
    if cuda:
        torch.cuda.reset_peak_memory_stats()


def free_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# -- trueflow ---------------------------------------------------------------------------------------------------------
@contextmanager
def trainer_hooks(cuda: bool, on_record: Callable[[dict, dict], None]) -> Iterator[dict]:
    """For the duration of a `trueflow train` run: each phase's peak memory (reset when the phase starts, read when
    it ends) and a callback after every metrics line with that step's peaks. Each wrapper calls the method it wraps
    unchanged; every one is put back on exit. Yields {"hooked": [...], "missing": [...]}."""
    from trueflow.rewards import base as rewards_base
    from trueflow.train import metrics, trainer

    peaks: dict[str, float | None] = {}
    found: dict[str, list[str]] = {"hooked": [], "missing": []}
    restore: list[tuple[Any, str, Any]] = []

    def begin() -> None:  # a phase starts: its peak is measured from here
        reset_peak(cuda)

    def finish(phase: str) -> Callable[..., None]:
        return lambda *args, **kwargs: peaks.__setitem__(phase, peak_gib(cuda))

    def wrap(owner: Any, name: str, before: Callable[[], None] | None, after: Callable[..., None] | None) -> None:
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        original = getattr(owner, name, None)
        if original is None:
            found["missing"].append(label)
            return

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if before:
                before()
            result = original(*args, **kwargs)
            if after:
                after(*args, **kwargs)
            return result

        setattr(owner, name, wrapper)
        restore.append((owner, name, original))
        found["hooked"].append(label)

    def reward_begins() -> None:
        if "rollout" not in peaks:  # a video's frames are scored one call each: the first call ends the rollout
            finish("rollout")()
            begin()

    def record_written(*args, **kwargs) -> None:  # MetricsWriter.write(self, record)
        on_record(kwargs.get("record", args[-1]), dict(peaks))
        peaks.clear()

    wrap(trainer.Trainer, "_rollout", begin, None)
    wrap(rewards_base, "score", reward_begins, finish("reward"))  # what `ScoredEngine` calls, found at call time
    wrap(trainer.Trainer, "_train_step", begin, finish("train"))
    wrap(trainer.Trainer, "_sync", begin, finish("sync"))
    wrap(metrics.MetricsWriter, "write", None, record_written)
    try:
        yield found
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)


def run_trueflow(args: argparse.Namespace, ckpt: Path, clip_dir: Path, work: Path, device: str,
                 results: Results, t_start: float) -> None:
    from trueflow.train.config import TrainConfig
    from trueflow.train.run import run_training

    cuda = device == "cuda"
    run_dir = work / "trueflow-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    prompt_file = work / "prompts.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    family, size = args.family, args.sample_size
    cfg = TrainConfig(
        output_dir=str(run_dir), checkpoint=str(ckpt), prompts=str(prompt_file), seed=0, sample_every=0, debug=False,
        dtype="bf16", lora_rank=LORA_RANK, gradient_checkpointing=True, fsdp_attention_backend=family.attention_backend,
        num_rollouts=args.rollouts, rollout_batch_size=args.prompts, n_samples_per_prompt=GROUP,
        rollout_microgroup_size=args.micro_batch, steps=STEPS, sampler="sde", noise_level=NOISE_LEVEL,
        num_sde_steps=SDE_STEPS, cfg_scale=family.cfg, negative_prompt=family.negative_prompt,
        max_sequence_length=MAX_SEQUENCE_LENGTH, resolution=size.height, width=size.width, num_frames=size.frames,
        rollout_patch_group=family.patch_group, num_steps_per_rollout=1, micro_batch_size_sample=args.micro_batch,
        micro_batch_size_tstep=1, device=device, engine_process=args.engine_process, reward="pickscore",
        reward_model=str(clip_dir), reward_frames=REWARD_FRAMES, reward_placement="trainer",
        train_kernels=args.train_kernels)
    results.info["trueflow_config"] = cfg.to_dict()
    last = [time.perf_counter()]

    def on_record(record: dict, peaks: dict) -> None:
        now = time.perf_counter()
        index = record["rollout"]
        row = results.add({
            "loop": "trueflow", "rollout": index, "warmup": index == 0, "prompts": rollout_prompts(index, args.prompts),
            "images": GROUP * args.prompts, "step_s": now - last[0],
            **{f"time_{p}": record.get(f"time_{p}") for p in PHASES},
            **{f"peak_gib_{p}": peaks.get(p) for p in PHASES},
            "model_output_max_abs_diff": record.get("model_output_max_abs_diff"),
            "log_prob_max_abs_diff": record.get("log_prob_max_abs_diff"),
            "checksums_equal": record.get("checksums_equal"), "reward_mean": record.get("reward_mean")})
        last[0] = now
        results.complete(row)
        results.save()
        print(f"[{now - t_start:6.0f} s] trueflow rollout {index}: " + progress(row), flush=True)

    print(f"[{time.perf_counter() - t_start:6.0f} s] trueflow: `trueflow train` API, {args.rollouts} rollouts",
          flush=True)
    reset_peak(cuda)
    with trainer_hooks(cuda, on_record) as found:
        results.info["trueflow_hooks"], results.info["trueflow_hooks_missing"] = found["hooked"], found["missing"]
        t0 = last[0] = time.perf_counter()
        run_training(cfg)
    results.info["trueflow_run_s"] = time.perf_counter() - t0
    results.info["trueflow_peak_gib"] = peak_gib(cuda)
    results.save()


def progress(row: dict) -> str:
    parts = [f"{p} {row[f'time_{p}']:.2f} s" for p in PHASES if row.get(f"time_{p}") is not None]
    return ", ".join(parts) + f"; step {row['step_s']:.2f} s, {row['images_per_gpu_s']:.3f} images/GPU/s"


# -- baseline: flow_grpo's loop on diffusers + PEFT -----------------------------------------------------------------
class Baseline:
    """flow_grpo's loop on the family's diffusers pipeline components + PEFT (`args.family` says which calls)."""

    def __init__(self, args: argparse.Namespace, ckpt: Path, clip_dir: Path, device: str):
        import diffusers
        from peft import LoraConfig, get_peft_model

        from trueflow.rewards.pickscore import PickScore
        from trueflow.models import get_family
        from trueflow.train.config import TrainConfig

        self.args, self.device, self.cuda = args, device, device == "cuda"
        self.family, self.size, self.spec = args.family, args.sample_size, get_family(args.family.name)
        pipe = getattr(diffusers, self.family.pipeline_class).from_pretrained(ckpt, dtype=BF16).to(device)
        self.family.prepare(pipe)
        for part in (pipe.vae, pipe.text_encoder, pipe.transformer):
            part.requires_grad_(False)
        pipe.transformer.enable_gradient_checkpointing()
        pipe.transformer.set_attention_backend(self.family.attention_backend)
        self.pipe = pipe
        self.model = get_peft_model(pipe.transformer, LoraConfig(
            r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights="gaussian",
            target_modules=list(self.spec.train.lora_targets)))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        defaults = TrainConfig()  # the trueflow run's optimizer and clipping settings
        self.clip_range, self.adv_clip, self.max_grad_norm = (defaults.clip_range, defaults.adv_clip_max,
                                                              defaults.max_grad_norm)
        self.optimizer = torch.optim.AdamW(self.params, lr=defaults.lr, weight_decay=defaults.weight_decay)
        self.reward = PickScore(str(clip_dir), device)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, sigma: torch.Tensor, cond: dict,
                 negative: dict | None) -> torch.Tensor:
        """The velocity the pipeline steps with: the forward (both branches, guided, with true CFG) under autocast,
        as flow_grpo runs it, then what the pipeline makes of the model's output (LTX-2.3: its x0 round trip)."""
        from trueflow.models.cfg import rescaled_cfg

        with torch.autocast(self.device, dtype=BF16):
            v = self.family.forward(self.model, x, t, cond, self.size)
            if negative is not None:
                v = rescaled_cfg(v, self.family.forward(self.model, x, t, negative, self.size), self.family.cfg)
        model_output = self.spec.pipeline.model_output
        return v if model_output is None else model_output(v, x, sigma)

    @torch.no_grad()
    def sample(self, prompt: str, n: int, seed: int) -> dict:
        """flow_grpo's pipeline_with_logprob for one microgroup: SDE steps (with log-probs) in a random window of
        SDE_STEPS steps, Euler steps elsewhere, then the VAE decode; uint8 images (or videos) on the CPU."""
        from trueflow.engine.samplers import ode_step, sde_step

        cond = self.family.encode(self.pipe, prompt, n, self.device)
        negative = self.family.encode(self.pipe, NEGATIVE_PROMPT, n, self.device) if self.family.cfg > 1 else None
        generators = [torch.Generator().manual_seed(seed + k) for k in range(n)]
        x = self.family.latents(self.pipe, self.size, n, generators, self.device)
        # (sigmas, timesteps) as the pipeline's __call__ sets them, by its own calls (`models.flow_schedule`)
        sigmas, timesteps = (v.to(self.device) for v in self.spec.pipeline.schedule(
            dict(self.pipe.scheduler.config), STEPS, x.shape[1], self.device))
        start = random.Random(seed).randrange(STEPS - SDE_STEPS + 1)
        window = range(start, start + SDE_STEPS)
        rec: dict[str, list] = {"latents": [], "next_latents": [], "log_probs": [], "steps": list(window)}
        for i, t in enumerate(timesteps):
            v = self.velocity(x, t, sigmas[i], cond, negative)
            if i in window:
                noise = torch.randn(x.shape, device=self.device, dtype=torch.float32)
                step = sde_step(x, v, sigmas[i], sigmas[i + 1], sigmas[1], NOISE_LEVEL, noise, x.dtype)
                rec["latents"].append(x)
                rec["next_latents"].append(step.x_next)
                rec["log_probs"].append(step.log_prob)
                x = step.x_next
            else:
                x = ode_step(x, v, sigmas[i], sigmas[i + 1])
        return {**rec, "cond": cond, "negative": negative, "sigmas": sigmas, "timesteps": timesteps,
                "images": self.family.decode(self.pipe, x, self.size)}

    def score(self, samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """PickScore of each image; of a video, the mean over REWARD_FRAMES evenly spread frames."""
        if samples.ndim == 4:
            return self.reward(samples, prompts).float()
        from trueflow.video import frame_indices

        frames = frame_indices(samples.shape[1], REWARD_FRAMES)
        return torch.stack([self.reward(samples[:, f].contiguous(), prompts).float() for f in frames]).mean(0)

    def train(self, groups: list[dict], advantages: torch.Tensor) -> None:
        """PPO-clip over every microgroup x window step, CFG in training (both branches with gradients), one backward
        each, then one clipped AdamW step."""
        from trueflow.engine.samplers import sde_log_prob

        n_terms = sum(len(g["steps"]) for g in groups)
        for g, adv in zip(groups, advantages.split([len(g["images"]) for g in groups])):
            adv = adv.to(self.device).clamp(-self.adv_clip, self.adv_clip)
            sigmas = g["sigmas"]
            for j, i in enumerate(g["steps"]):
                x, t = g["latents"][j], g["timesteps"][i]
                v = self.velocity(x, t, sigmas[i], g["cond"], g["negative"])
                log_prob, _, _ = sde_log_prob(g["next_latents"][j], x, v, sigmas[i], sigmas[i + 1], sigmas[1],
                                              NOISE_LEVEL)
                ratio = torch.exp(log_prob - g["log_probs"][j])
                loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - self.clip_range, 1 + self.clip_range)).mean()
                (loss / n_terms).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, index: int, phase: Callable) -> torch.Tensor:
        """One rollout + reward + train step (`phase(name)` times each part); returns the rewards."""
        prompts = rollout_prompts(index, self.args.prompts)
        mb = self.args.micro_batch
        with phase("rollout"):
            self.model.eval()
            groups = [self.sample(p, mb, seed=1_000_003 * index + GROUP * k + m)
                      for k, p in enumerate(prompts) for m in range(0, GROUP, mb)]
        with phase("reward"):
            images = torch.cat([g["images"] for g in groups])
            rewards = self.score(images, [p for p in prompts for _ in range(GROUP)])
        with phase("train"):
            # flow_grpo's per-prompt stat tracker: (reward - group mean) / (group std + 1e-4)
            r = rewards.view(len(prompts), GROUP)
            advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + 1e-4)).flatten()
            self.model.train()
            self.train(groups, advantages)
        return rewards


def run_baseline(args: argparse.Namespace, ckpt: Path, clip_dir: Path, device: str, results: Results,
                 t_start: float) -> None:
    cuda = device == "cuda"
    t0 = time.perf_counter()
    baseline = Baseline(args, ckpt, clip_dir, device)
    results.info["baseline_build_s"] = time.perf_counter() - t0
    print(f"[{time.perf_counter() - t_start:6.0f} s] baseline: diffusers + PEFT built in "
          f"{results.info['baseline_build_s']:.0f} s, {args.rollouts} rollouts", flush=True)
    for index in range(args.rollouts):
        row = results.add({"loop": "baseline", "rollout": index, "warmup": index == 0,
                           "prompts": rollout_prompts(index, args.prompts), "images": GROUP * args.prompts,
                           "time_sync": 0.0, "peak_gib_sync": None, "model_output_max_abs_diff": None})

        @contextmanager
        def phase(name: str, row: dict = row) -> Iterator[None]:  # the row of this rollout
            if cuda:
                torch.cuda.synchronize()
            reset_peak(cuda)
            t = time.perf_counter()
            yield
            if cuda:
                torch.cuda.synchronize()
            row[f"time_{name}"], row[f"peak_gib_{name}"] = time.perf_counter() - t, peak_gib(cuda)
            results.save()

        t = time.perf_counter()
        rewards = baseline.step(index, phase)
        row["step_s"] = time.perf_counter() - t
        row["reward_mean"] = rewards.mean().item()
        results.complete(row)
        results.save()
        print(f"[{time.perf_counter() - t_start:6.0f} s] baseline rollout {index}: " + progress(row), flush=True)
    del baseline


# -- the run ----------------------------------------------------------------------------------------------------------
COLUMNS = (("rollout s", "time_rollout", ".2f"), ("reward s", "time_reward", ".2f"), ("train s", "time_train", ".2f"),
           ("sync s", "time_sync", ".2f"), ("step s", "step_s", ".2f"), ("img/GPU/s", "images_per_gpu_s", ".3f"),
           ("TF/s roll", "tflops_rollout", ".1f"), ("TF/s rew", "tflops_reward", ".1f"),
           ("TF/s train", "tflops_train", ".1f"), ("GiB roll", "peak_gib_rollout", ".1f"),
           ("GiB train", "peak_gib_train", ".1f"), ("max|dv|", "model_output_max_abs_diff", ".2g"))


def print_table(results: Results) -> None:
    head = f"{'loop':9s} {'step':>4s} " + " ".join(f"{name:>10s}" for name, _, _ in COLUMNS)
    print("\n" + head + "\n" + "-" * len(head))
    for r in results.rows:
        cells = ("-" if r.get(key) is None else format(r[key], spec) for _, key, spec in COLUMNS)
        print(f"{r['loop']:9s} {r['rollout']:>4d} " + " ".join(f"{c:>10s}" for c in cells)
              + ("  (warm-up, not in the summary)" if r["warmup"] else ""))
    s = results.summary()
    for loop in ("trueflow", "baseline"):
        if f"{loop}_error" in results.info:
            print(f"{loop} FAILED: {results.info[f'{loop}_error']}")
        if loop in s:
            m = s[loop]
            print(f"{loop}: median of {m['measured_steps']} steps: {m['step_s']:.2f} s/step "
                  f"(rollout {m['time_rollout']:.2f}, reward {m['time_reward']:.2f}, train {m['time_train']:.2f}, "
                  f"sync {m['time_sync']:.2f}), {m['images_per_step']} images: {m['images_per_gpu_s']:.3f} "
                  "images/GPU/s")
    for loop in ("trueflow", "baseline"):
        if s.get(loop, {}).get("floor_at_gemm_ceiling_s"):
            m = s[loop]
            print(f"{loop}: the step's FLOPs at the GEMM ceiling ({results.info['gemm_tflops']:.0f} TFLOP/s) take "
                  f"{m['floor_at_gemm_ceiling_s']:.2f} s of its {m['step_s']:.2f} s "
                  f"({100 * m['floor_at_gemm_ceiling_s'] / m['step_s']:.0f}%)")
    if "speedup_images_per_gpu_s" in s:
        goal = GOAL_SPEEDUP.get(results.family)
        print(f"trueflow / baseline images/GPU/s: {s['speedup_images_per_gpu_s']:.2f}x"
              + (f" (goal >= {goal:g}x: {'met' if s['goal_2x_met'] else 'missed'})" if goal else ""))
    diffs = [r["model_output_max_abs_diff"] for r in results.rows if r["loop"] == "trueflow"]
    if diffs:
        print("trueflow train/rollout mismatch (model_output_max_abs_diff) at every step:", diffs)
    print("published, for context (other settings and real weights; not like for like):")
    for p in PEERS[results.family]:
        print(f"  {p['name']} on {p['hardware']}: {p['images_per_gpu_s']} images/GPU/s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file (rewritten after every phase)")
    ap.add_argument("--family", default="qwen_image", choices=tuple(FAMILIES),
                    help="qwen_image (images) or ltx2 (LTX-2.3 videos)")
    ap.add_argument("--size", default="full", choices=("full", "tiny"), help="tiny: a CPU smoke run")
    ap.add_argument("--resolution", type=int, default=512,
                    help="image side (qwen_image: 512 or 1024), or video height (ltx2: 512); tiny: any multiple of "
                         "the family's granule (16, 32)")
    ap.add_argument("--width", type=int, default=None, help="ltx2: video width (default: 1.5 x --resolution)")
    ap.add_argument("--num-frames", type=int, default=None, help="ltx2: frames a video (default 33)")
    ap.add_argument("--rollouts", type=int, default=3, help="steps per loop, the first a warm-up (>= 2)")
    ap.add_argument("--prompts", type=int, default=2, help=f"prompts per step (x a group of {GROUP} samples)")
    ap.add_argument("--micro-batch", type=int, default=8, choices=(8, 4),
                    help="samples per rollout microgroup = per train micro-batch (4 if 8 does not fit)")
    ap.add_argument("--train-kernels", choices=("stock", "fused"), default="stock",
                    help="trueflow's train side on diffusers' kernels or the eager-exact fused ones (the same "
                         "forward bits; the baseline stays stock)")
    ap.add_argument("--engine-process", action="store_true",
                    help="trueflow's engine in its own process, LoRA synced by CUDA IPC (default: embedded, one "
                         "process); peak memory then covers the trainer's process only")
    ap.add_argument("--workdir", help="where the checkpoint, reward model and run go, reused if there "
                                      "(default: a temporary folder, removed at the end)")
    args = ap.parse_args(argv)
    family = args.family = FAMILIES[args.family]
    if args.rollouts < 2:
        raise UsageError(f"--rollouts {args.rollouts}: need >= 2 (the first is a warm-up, left out)")
    if args.prompts < 1:
        raise UsageError(f"--prompts {args.prompts}: need >= 1")
    default = family.default_size(args.resolution)
    size = args.sample_size = Size(args.resolution, default.width if args.width is None else args.width,
                                   default.frames if args.num_frames is None else args.num_frames)
    if args.train_kernels == "fused" and family.name != "qwen_image":
        raise UsageError(f"--train-kernels fused is Qwen-Image's: the {family.name} family has no train kernels")
    if family.name != "ltx2" and (args.width is not None or args.num_frames is not None):
        raise UsageError(f"--width and --num-frames are ltx2's: {family.name} images are --resolution square")
    for flag, side in (("--resolution", size.height), ("--width", size.width)):
        if side % family.granule or side < family.granule:
            raise UsageError(f"{flag} {side}: must be a positive multiple of {family.granule}")
    if size.frames % 8 != 1:
        raise UsageError(f"--num-frames {size.frames}: must be 8k + 1 (LTX-2.3's VAE compresses 8 frames)")
    if args.size == "full" and size not in family.full_sizes:
        shapes = " or ".join(f"{s.width}x{s.height}" + (f", {s.frames} frames" if s.frames > 1 else "")
                             for s in family.full_sizes)
        raise UsageError(f"{size.width}x{size.height}" + (f", {size.frames} frames" if size.frames > 1 else "")
                         + f": the full-size {family.name} recipe runs at {shapes}")
    if args.size == "full" and not torch.cuda.is_available():
        raise UsageError("--size full needs a CUDA GPU; use --size tiny for the CPU smoke run")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"grpo_step.py: error: {e}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    device = "cuda" if args.size == "full" else "cpu"
    cuda = device == "cuda"
    import diffusers
    import peft
    import transformers

    from trueflow.models import get_family

    family, size = args.family, args.sample_size
    info = {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d"), "size": args.size, "gpus": 1,
            "recipe": {"family": family.name, "resolution": size.height, "width": size.width,
                       "num_frames": size.frames, "steps": STEPS, "num_sde_steps": SDE_STEPS,
                       "group": GROUP, "prompts_per_step": args.prompts, "micro_batch": args.micro_batch,
                       "trueflow_placement": "engine process" if args.engine_process else "embedded",
                       "cfg_scale": family.cfg, "noise_level": NOISE_LEVEL, "lora_rank": LORA_RANK,
                       "max_sequence_length": MAX_SEQUENCE_LENGTH, "attention_backend": family.attention_backend,
                       "gradient_checkpointing": True, "train_kernels": args.train_kernels,
                       "reward": "pickscore (random CLIP, " + ("ViT-H/14 size)" if args.size == "full" else "tiny)")
                       + (f" on {REWARD_FRAMES} frames a video" if size.frames > 1 else "")},
            "flops_note": "transformer GEMM + attention FLOPs of the forwards each phase runs (train: x3 for "
                          "backward, recomputation not counted); reward: the CLIP towers"}
    results = Results(Path(args.out), info, family.name)
    results.save()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="grpo_step-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        ckpt = write_checkpoint(work / f"checkpoint-{family.name}-{args.size}", family.name, args.size, device)
        clip_dir = write_reward_model(work / f"clip-{args.size}", args.size, device)
        info["setup_s"] = time.perf_counter() - t0
        free_memory(cuda)  # the checkpoint writer's 40 GB model
        print(f"[{time.perf_counter() - t_start:6.0f} s] checkpoint and reward model ready in {info['setup_s']:.0f} s",
              flush=True)
        config = get_family(family.name).presets.transformer_config(args.size)
        results.flops = FlopCounter(args, config, clip_dir, family.text_lengths(ckpt))
        info["text_lengths"] = results.flops.text_lens
        if cuda:
            import rollout_vs_diffusers as rvd

            info["gemm_tflops"] = rvd.gemm_ceiling_tflops()
        for loop, run in (("trueflow", lambda: run_trueflow(args, ckpt, clip_dir, work, device, results, t_start)),
                          ("baseline", lambda: run_baseline(args, ckpt, clip_dir, device, results, t_start))):
            try:
                run()
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded, and the other loop still runs
                traceback.print_exc()
                info[f"{loop}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                print(f"{loop} FAILED: {info[f'{loop}_error']}", flush=True)
            free_memory(cuda)
    finally:
        info["total_s"] = time.perf_counter() - t_start
        results.save()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    return 1 if any(f"{loop}_error" in info for loop in ("trueflow", "baseline")) else 0


if __name__ == "__main__":
    raise SystemExit(main())
