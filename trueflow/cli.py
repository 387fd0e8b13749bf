"""`trueflow <verb>`: the command line. Each verb is a function taking parsed arguments.

Each verb checks its choices, files and folders first (`_check_*`), with nothing heavy imported yet: a user error
is one line (exit 2) before torch's heavy parts or diffusers load (tests/test_startup.py). Only the model family
registry is read for that (it reads model_index.json and the families' specs, which load torch's core and nothing
else), so that family-dependent choices (the patch group, the image size's granule) are refused as early.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .dtypes import DTYPES
from .options import (Parser, add_engine_options, add_lora_options, add_output_dir, add_renamed, add_reward_options,
                      add_sampling_options, add_size_options, size_of)

if TYPE_CHECKING:
    from .engine.sampling_params import SamplingParams
    from .parity.probe import ProbeResult
    from .placement import EngineSpec, Placement
    from .lora_files import LoraFile
    from .models.spec import ModelFamily


# -- checks shared by the verbs (before anything heavy loads) ---------------------------------------------------
def _pipeline_family(checkpoint: str, family: str | None = None, whole: bool = True) -> ModelFamily:
    """The family of `--checkpoint` (its model_index.json against the family registry); `whole`: it must be a
    whole pipeline folder (an engine needs its text encoder and VAE), else a transformer/ folder will do."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no such folder (`trueflow init-checkpoint --output-dir "
                                "DIR` writes a tiny one)")
    if whole and not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"--checkpoint {checkpoint}: not a diffusers pipeline folder (no model_index.json; "
                                "`trueflow init-checkpoint --output-dir DIR` writes one)")
    from .models import family_for_checkpoint

    return family_for_checkpoint(path, family)


def _check_engine_options(a: argparse.Namespace, fam: ModelFamily) -> None:
    """The patch group (default: the family's parity group; another family's refused; in the batch-invariant mode's
    form with `--batch-invariant`), the patches switched off, the thread count: `a` is updated in place."""
    from .models import patch_group_for
    from .models import get_group

    a.patch_group = patch_group_for(fam, a.patch_group)
    if a.batch_invariant:
        from .models import batch_invariant_group

        a.patch_group = batch_invariant_group(a.patch_group)
    if a.disable_patch:
        group = get_group(a.patch_group)
        if group is None:
            raise ValueError("--disable-patch needs a patch group; --patch-group none applies no patches")
        unknown = sorted(set(a.disable_patch) - set(group.patch_names))
        if unknown:
            raise ValueError(f"--disable-patch {', '.join(unknown)}: not a patch of group {a.patch_group!r} (its "
                             f"patches: {', '.join(group.patch_names)})")
    _check_threads(a)
    if getattr(a, "tp", 1) < 1:
        raise ValueError(f"--tp must be >= 1, got {a.tp}")


def _check_threads(a: argparse.Namespace) -> None:
    if a.threads is not None and a.threads < 1:
        raise ValueError(f"--threads {a.threads}: must be >= 1")


def _set_threads(a: argparse.Namespace) -> None:
    """torch's intra-op threads as `--threads` says (CPU parity needs the same count on both sides)."""
    if a.threads is not None:
        import torch

        torch.set_num_threads(a.threads)


# SamplingParams' field names in its messages, as the flags that set them.
_FIELD_FLAGS = {"steps": "--steps", "noise_level": "--noise-level", "cfg_scale": "--cfg-scale", "fps": "--fps",
                "num_frames": "--num-frames", "sampler": "--sampler"}


def _flag_named(message: str) -> str:
    message = re.sub(r"sampler='(\w+)'", r"--sampler \1", message)
    return re.sub(r"\b(" + "|".join(_FIELD_FLAGS) + r")\b", lambda m: _FIELD_FLAGS[m[1]], message)


def _sampling_params(a: argparse.Namespace, fam: ModelFamily) -> SamplingParams:
    """The verb's sampling flags as `SamplingParams`, checked against the family, each error naming the flag the
    user typed (`--resolution 70: must be a multiple of 16 ...`)."""
    from .engine.sampling_params import SamplingParams, check_family_limits

    image = getattr(a, "image", None)
    height, width, h_flag, w_flag = size_of(a)
    granule = fam.pipeline.pixels_per_token
    for flag, v in dict.fromkeys([(h_flag, height), (w_flag, width)]):
        if v < granule or v % granule:
            raise ValueError(f"{flag}: must be a positive multiple of {granule} pixels for {fam.name} "
                             f"({fam.pipeline.size_reason})")
    try:
        fam.pipeline.latent_grid(height, width, a.num_frames)
    except ValueError as e:
        raise ValueError(f"--num-frames {a.num_frames}: {e}") from None
    try:
        params = SamplingParams(steps=a.steps, sampler=a.sampler, noise_level=a.noise_level, cfg_scale=a.cfg_scale,
                                cfg_scale_2=a.cfg_scale_2, distilled_guidance_scale=a.distilled_guidance_scale,
                                negative_prompt=a.negative_prompt, height=height, width=width,
                                num_frames=a.num_frames, fps=a.fps, max_sequence_length=a.max_sequence_length,
                                image=image)
        check_family_limits(params, fam)  # what the engine would refuse after loading (an image, the guidance)
    except ValueError as e:
        raise ValueError(_flag_named(str(e))) from None
    if image is not None and not Path(image).is_file():
        raise FileNotFoundError(f"--image {image}: no such file; image-to-video needs its first frame as an image file")
    return params


def _check_output_dir(path: str) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output-dir {path} is a file: name a folder")
    return out


def _check_lora(a: argparse.Namespace, fam: ModelFamily) -> LoraFile | None:
    from .lora_files import find_lora

    if a.lora is None:
        if a.ema:
            raise ValueError("--ema picks a checkpoint's EMA twin: give --lora RUN_OR_CHECKPOINT_DIR too")
        return None
    return find_lora(a.lora, a.ema, fam, a.checkpoint)


def _engine_placement(a: argparse.Namespace, **spec: Any) -> tuple[EngineSpec, Placement]:
    """(EngineSpec, Placement) of a verb's engine options: in this process, or over `--tp` processes of its own."""
    from .placement import EngineSpec, Placement

    engine = EngineSpec(a.checkpoint, a.patch_group, tuple(a.disable_patch), a.dtype, a.device, **spec)
    return engine, Placement("process" if a.tp > 1 else "local", tp=a.tp)


# -- init-checkpoint -----------------------------------------------------------------------------------------
def _add_init_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default=None,
                   help="model family, a folder of trueflow/models (default: the default family)")
    p.add_argument("--size", default="tiny", help="architecture size written to disk (default: tiny)")
    add_output_dir(p, "the pipeline folder to write (must not exist or be empty)", "--out")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the transformer's weights, as stored "
                   "(default: fp32)")
    p.add_argument("--device", default="cpu", help="where the random weights are drawn (a GPU for --size full)")


def _run_init_checkpoint(a: argparse.Namespace) -> int:
    out = _check_output_dir(a.output_dir)
    if out.is_dir() and any(out.iterdir()) and not a.overwrite:
        raise FileExistsError(f"--output-dir {a.output_dir} exists and is not empty: add --overwrite to replace it")
    from .models import default_family, get_family

    fam = get_family(a.family) if a.family is not None else default_family()
    from .checkpoints import init_checkpoint
    from .dtypes import torch_dtype

    path = init_checkpoint(out, family=fam.name, size=a.size, seed=a.seed, overwrite=a.overwrite,
                           dtype=torch_dtype(a.dtype), device=a.device)
    print(f"wrote a {a.size} {fam.name} checkpoint to {path}")
    return 0


# -- parity --------------------------------------------------------------------------------------------------
def _add_parity(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="diffusers pipeline folder (or a folder holding transformer/)")
    src.add_argument("--random-size", choices=("tiny", "one_block", "full"),
                     help="an in-memory architecture with seeded random weights instead of a checkpoint")
    p.add_argument("--family", default=None, help="model family of --random-size, or of a folder whose "
                   "model_index.json names none (default: the default family)")
    add_engine_options(p)
    # Not --n-samples-per-prompt: the probe's batch is B independent random inputs of one forward (a microgroup's
    # shape), not samples of one prompt.
    p.add_argument("--batch", type=int, default=1, metavar="B", help="batch of the compared forward: B seeded "
                   "random inputs, the shape of a rollout microgroup of B (default: 1)")
    p.add_argument("--text-len", type=int, default=7, metavar="L", help="text tokens per sample (default: 7)")
    p.add_argument("--train-micro-batch", type=int, default=None, metavar="N",
                   help="run the train side in micro-batches of N samples against the engine's one batch: bitwise "
                        "only with --batch-invariant (default: the whole batch, as one microgroup)")
    p.add_argument("--resolution", type=int, default=64, metavar="PX", help="image side in pixels, a multiple of "
                   "the family's granule (default: 64)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="add a PEFT LoRA of this rank with non-zero B (default: none)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: the rank)")
    p.add_argument("--lora-merge-mode", choices=("unmerged", "merged"), default=None,
                   help="how the engine takes the LoRA (default: the patch group's choice)")
    p.add_argument("--expert", default=None, help="the checkpoint's transformer to compare, a pipeline component "
                   "such as transformer_2 (default: the first)")
    p.add_argument("--cfg-scale", type=float, default=1.0, help="> 1: compare a CFG step's guided output, the "
                   "branches run as the family runs them (default: 1, the model output)")
    p.add_argument("--layer-report", choices=("all", "blocks", "none"), default="all",
                   help="modules compared per layer: all, whole blocks only (less memory at full size), or none (the "
                        "model output alone)")
    p.add_argument("--ablate", action="store_true", help="also run with each patch of the group switched off alone")
    add_output_dir(p, "also write inputs, engine output, LoRA and a manifest to DIR (docs/parity-probe.md)", "--save",
                   required=False)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the engine, one process each "
                   "(docs/tensor-parallel.md; default: 1)")
    p.add_argument("--train-tp-match", type=int, default=None, metavar="N",
                   help="run each sharded layer of the train side as the engine's N ranks do (N = --tp): bitwise "
                        "under TP (default: stock diffusers)")


def _check_parity(a: argparse.Namespace) -> None:
    if a.checkpoint is not None:
        fam = _pipeline_family(a.checkpoint, a.family, whole=False)
    else:
        from .models import default_family, get_family

        fam = get_family(a.family) if a.family is not None else default_family()
    _check_engine_options(a, fam)
    granule = fam.pipeline.pixels_per_token
    if a.resolution < granule or a.resolution % granule:
        raise ValueError(f"--resolution {a.resolution}: must be a positive multiple of {granule} pixels for "
                         f"{fam.name} ({fam.pipeline.size_reason})")
    for flag, v, least in (("--batch", a.batch, 1), ("--text-len", a.text_len, 1), ("--lora-rank", a.lora_rank, 0),
                           ("--train-micro-batch", 1 if a.train_micro_batch is None else a.train_micro_batch, 1)):
        if v < least:
            raise ValueError(f"{flag} {v}: must be >= {least}")
    if (a.tp != 1 or a.train_tp_match is not None) and (a.ablate or a.output_dir or a.expert or a.cfg_scale != 1):
        raise ValueError("--ablate, --output-dir, --expert and --cfg-scale run at --tp 1; drop them or --tp")
    if a.output_dir:
        _check_output_dir(a.output_dir)


def _run_parity(a: argparse.Namespace) -> int:
    _check_parity(a)
    _set_threads(a)
    from .parity.probe import ParityProbe, ProbeSpec
    from .parity.report import format_ablation, format_result

    spec = ProbeSpec(checkpoint=a.checkpoint, random_size=a.random_size, batch=a.batch, text_len=a.text_len,
                     resolution=a.resolution, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, dtype=a.dtype,
                     seed=a.seed, device=a.device, lora_merge_mode=a.lora_merge_mode,
                     layer_report=a.layer_report, expert=a.expert, cfg_scale=a.cfg_scale, family=a.family,
                     batch_invariant=a.batch_invariant, train_micro_batch=a.train_micro_batch)
    result: ProbeResult  # a TPProbeResult under --tp
    if a.tp != 1 or a.train_tp_match is not None:
        from .parity.tp import run_tp_probe

        result, ablation = run_tp_probe(spec, a.tp, a.train_tp_match, a.patch_group, tuple(a.disable_patch)), None
    else:
        probe = ParityProbe(spec)
        result, engine_output = probe.run(a.patch_group, tuple(a.disable_patch))
        ablation = probe.ablate(a.patch_group) if a.ablate else None
        if a.output_dir:
            probe.save(a.output_dir, result, engine_output)
    if a.json:
        out = result.to_json()
        out["layers"] = [vars(r) for r in result.layers]
        if ablation is not None:
            out["ablation"] = [r.to_json(with_layers=False) for r in ablation]
        print(json.dumps(out))
    else:
        print(format_result(spec, result))
        if a.tp != 1 or a.train_tp_match is not None:
            from .parity.tp import TPProbeResult

            assert isinstance(result, TPProbeResult)  # run_tp_probe's
            print(f"  tensor parallel {result.tp}, train side {'TP-matched' if result.train_tp_match else 'stock'}, "
                  f"{result.collectives_per_forward} collectives per forward (rank-ordered sums, all-gathers)"
                  + (", each rank's LoRA slice confirmed by checksum" if spec.lora_rank else ""))
        if ablation is not None:
            print(format_ablation(ablation))
    return 0


# -- generate ------------------------------------------------------------------------------------------------
def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="diffusers pipeline folder")
    p.add_argument("--prompt", required=True, help="the prompt")
    p.add_argument("--negative-prompt", default=None, help="negative prompt of true CFG (default: the family's: ' ' "
                   "for Qwen-Image, '' for SD3; none for FLUX.1, whose pipeline runs no CFG without one)")
    p.add_argument("--max-sequence-length", type=int, default=512, metavar="N", help="text tokens of the prompt: "
                   "the pipeline's max_sequence_length (default: 512)")
    add_renamed(p, "--n-samples-per-prompt", "--num-images", type=int, default=1, metavar="N",
                help="samples of the prompt, run as one batch (default: 1)")
    add_sampling_options(p)
    add_size_options(p)
    p.add_argument("--num-frames", type=int, default=1, help="frames per sample: 1 for images; a video family's "
                   "count (LTX-2.3: 8k + 1) writes MP4s and frame strips (default: 1)")
    p.add_argument("--fps", type=float, default=24.0, help="a video's frame rate: what a video family conditions on "
                   "and the MP4s play at (default: 24)")
    p.add_argument("--image", metavar="FILE", help="image-to-video: the first frame, an image file (a family or "
                   "layout that takes one: Wan2.2 TI2V-5B); default: text-to-video")
    add_engine_options(p)
    add_lora_options(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the engine, one process each "
                   "(docs/tensor-parallel.md; default: 1, in this process)")
    p.add_argument("--snapshot", metavar="FILE", help="also write a debug snapshot of every step (docs/snapshot.md)")
    add_output_dir(p, "output folder for the PNGs (or MP4s) and settings.json", "--out")


def _run_generate(a: argparse.Namespace) -> int:
    fam = _pipeline_family(a.checkpoint)
    _check_engine_options(a, fam)
    params = _sampling_params(a, fam)
    if a.n_samples_per_prompt < 1:
        raise ValueError(f"--n-samples-per-prompt {a.n_samples_per_prompt}: must be >= 1")
    lora = _check_lora(a, fam)
    out = _check_output_dir(a.output_dir)
    _set_threads(a)

    from dataclasses import asdict

    from .engine.request import RolloutRequest
    from .placement import build_engine

    request = RolloutRequest([a.prompt], a.n_samples_per_prompt, params, a.seed,
                             record_snapshot=a.snapshot is not None)
    engine = build_engine(*_engine_placement(a, progress=sys.stderr.isatty()))
    try:
        lora_checksum = _install_lora(engine, lora) if lora is not None else None
        rollout = engine.rollout(request)
    finally:
        engine.shutdown()
    from PIL import Image

    from .engine.snapshot import save_snapshot
    from .video import write_mp4, write_strip

    out.mkdir(parents=True, exist_ok=True)
    assert rollout.images is not None  # the request decodes
    for i, sample in enumerate(rollout.images):
        if sample.ndim == 4:  # a video [F, H, W, 3]
            write_mp4(sample, out / f"{i:04d}.mp4", params.fps)
            write_strip(sample, out / f"{i:04d}-frames.png")
        else:
            Image.fromarray(sample.numpy()).save(out / f"{i:04d}.png")
    settings = {"prompt": a.prompt, "n_samples_per_prompt": a.n_samples_per_prompt, "seed": a.seed,
                "params": asdict(params), "engine": rollout.engine,
                "lora": None if lora is None else {"path": str(lora.path), "scale": lora.scale, "rank": lora.rank,
                                                   "checksum": lora_checksum},
                "sde_steps": [mg.sde_steps for mg in rollout.microgroups], "snapshot": a.snapshot}
    (out / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    if a.snapshot:
        save_snapshot(rollout, a.snapshot)
    kind = "video(s)" if rollout.images.ndim == 5 else "image(s)"
    print(f"wrote {len(rollout.images)} {kind} and settings.json to {out}" +
          (f" (LoRA {lora.path})" if lora else "") + (f", snapshot to {a.snapshot}" if a.snapshot else ""))
    return 0


def _install_lora(engine, lora: LoraFile) -> str:
    """Put a checked LoRA file into a built engine, through the engine interface (as a trainer's sync does)."""
    from .lora_files import load_lora

    return engine.update_weights(load_lora(lora), lora.scale)


# -- train -----------------------------------------------------------------------------------------------------
def _add_train(p: argparse.ArgumentParser) -> None:
    from .train.config import add_arguments

    p.set_defaults(train_settings=add_arguments(p))


def _run_train(a: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .train.config import config_from_args, format_error

    try:  # types, ranges and combinations: before anything is loaded
        cfg = config_from_args(a, a.train_settings)
    except ValidationError as e:
        raise ValueError(format_error(e)) from None
    if a.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from .engine.interface import EngineDied

    cfg.preflight()  # files, folders, the patch group: still nothing heavy loaded
    from .ray import RayRunError
    from .rewards.base import RewardError
    from .train.checkpoint import resume_point
    from .train.run import run_training

    try:
        if cfg.ray:  # this process is the driver; the Ray actors run `run_training` (docs/scaling.md)
            from .ray.launch import run_ray

            out: Path | None = run_ray(cfg)
        else:
            out = run_training(cfg)
    except RayRunError as e:  # an actor died or a rank failed: one line naming it
        print(f"trueflow train: error: {e}", file=sys.stderr)
        return 1
    except EngineDied as e:  # its process, a TP rank or its server: one line naming it
        print(f"trueflow train: error: {e}; the run stopped; {resume_point(cfg.output_dir)}", file=sys.stderr)
        return 1
    except RewardError as e:  # the user's reward failed: the run stops, its last checkpoint (if any) intact
        raise ValueError(f"{e} (the run stopped; fix the reward; {resume_point(cfg.output_dir)}; or "
                         "--reward-on-error skip drops failing prompt groups)") from None
    except KeyboardInterrupt:  # Ctrl-C: what was written stays; the run resumes from its last checkpoint
        print(f"trueflow train: interrupted ({resume_point(cfg.output_dir)})", file=sys.stderr)
        return 130
    if out is not None:
        print(f"run written to {out} (metrics.jsonl, summary.md, samples/, checkpoints/)")
    return 0


# -- patches -------------------------------------------------------------------------------------------------
def _add_patches(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default=None, help="model family whose parity group to list (default: the "
                   "default family)")
    p.add_argument("--patch-group", default=None, metavar="GROUP", help="group to list (default: the family's "
                   "parity group)")


def _run_patches(a: argparse.Namespace) -> int:
    from .models import default_family, family_for_patch_group, get_family, patch_group_for
    from .models import get_group

    if a.family is not None:
        name = patch_group_for(get_family(a.family), a.patch_group)
    else:
        name = a.patch_group if a.patch_group is not None else patch_group_for(default_family(), None)
        family_for_patch_group(name)  # an unknown name is refused with the known ones
    group = get_group(name)
    for patch in group.patches if group else ():
        print(f"{patch.name:40s} {patch.summary}")
    return 0


# -- reward --------------------------------------------------------------------------------------------------
def _reward_names() -> str:
    from .rewards import REWARDS

    return ", ".join(REWARDS)


def _add_reward(p: argparse.ArgumentParser) -> None:
    add_reward_options(p, _reward_names(), required=True)
    p.add_argument("--image", required=True, metavar="PNG", help="image file (any format PIL reads)")
    p.add_argument("--prompt", required=True, help="the prompt the image was generated for")


def _run_reward(a: argparse.Namespace) -> int:
    if not Path(a.image).is_file():
        raise FileNotFoundError(f"--image {a.image}: no such file")
    _check_threads(a)
    _set_threads(a)
    import numpy as np
    import torch
    from PIL import Image, UnidentifiedImageError

    from .rewards import RewardError, build_reward, score

    try:
        with Image.open(a.image) as image:
            pixels = torch.from_numpy(np.array(image.convert("RGB")))[None]
    except UnidentifiedImageError:
        raise ValueError(f"--image {a.image}: not an image PIL reads") from None
    try:
        scores, _ = score(build_reward(a.reward, a.reward_model, a.device, url=a.reward_url), pixels, [a.prompt])
    except RewardError as e:
        print(f"trueflow reward: error: {e}", file=sys.stderr)
        return 1
    print(repr(scores[0].item()))
    return 0


# -- reward-serve --------------------------------------------------------------------------------------------
def _add_reward_serve(p: argparse.ArgumentParser) -> None:
    add_reward_options(p, _reward_names(), required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--max-batch", type=int, default=64, metavar="N",
                   help="most images in one merged reward call (default: 64)")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="how long the first request waits for others to batch with (default: 5)")
    p.add_argument("--max-body-mb", type=float, default=256.0, metavar="MB",
                   help="largest /score body taken, in MiB; a larger one is refused (413) unread (default: 256)")


def _run_reward_serve(a: argparse.Namespace) -> int:
    _check_threads(a)
    if a.max_batch < 1:
        raise ValueError(f"--max-batch {a.max_batch}: must be >= 1")
    if not (math.isfinite(a.max_wait_ms) and a.max_wait_ms >= 0):
        raise ValueError(f"--max-wait-ms {a.max_wait_ms}: must be a finite number >= 0")
    if not (math.isfinite(a.max_body_mb) and a.max_body_mb > 0):
        raise ValueError(f"--max-body-mb {a.max_body_mb}: must be a finite number > 0")
    _set_threads(a)
    from .rewards.server import serve

    serve(a.reward, host=a.host, port=a.port, model_path=a.reward_model, device=a.device, max_batch=a.max_batch,
          max_wait_ms=a.max_wait_ms, url=a.reward_url, max_body_bytes=int(a.max_body_mb * (1 << 20)))
    return 0


# -- serve ---------------------------------------------------------------------------------------------------
def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="diffusers pipeline folder")
    add_engine_options(p, seed=None, seed_help="random seed of every OpenAI-style request that names none "
                       "(default: a new one per request, returned in the answer)")
    add_lora_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; IPC weight updates are "
                   "taken from loopback clients only)")
    p.add_argument("--port", type=int, default=8001, help="port (default: 8001; reward-serve's is 8000)")
    p.add_argument("--weights-root", default=None, metavar="DIR", help="folder whose safetensors files and "
                   "checkpoints weight updates may name by path (default: none; path updates are refused)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the engine, one process each (on CUDA "
                   "rank r on GPU r; docs/tensor-parallel.md; default: 1, in this process)")
    p.add_argument("--max-merged", type=int, default=8, metavar="N", help="with --batch-invariant: most rollouts run "
                   "at once with their forwards merged into one batch (default: 8)")
    # The defaults are `server.Limits`' (a test keeps them equal; importing it here would load torch).
    for flag, kind, default, what in [
            ("--max-steps", int, 100, "most denoising steps per sample"),
            ("--max-pixels", int, 2048 * 2048, "most pixels (height x width) of one image frame"),
            ("--max-frames", int, 1, "most frames per sample (image families make 1)"),
            ("--max-prompt-tokens", int, 1024, "most tokens of a prompt or negative prompt"),
            ("--max-samples", int, 64, "most samples (prompts x n) per request"),
            ("--max-queue", int, 16, "most engine calls a generation request may find waiting (more: 503)"),
            ("--request-timeout", float, 3600.0,
             "seconds a generation request may take, queue included, before its rollout stops (504)")]:
        p.add_argument(flag, type=kind, default=default, metavar="N" if kind is int else "SECONDS",
                       help=f"{what} (default: {default})")


def _run_serve(a: argparse.Namespace) -> int:
    from .server.limits import Limits

    limits = Limits(a.max_steps, a.max_pixels, a.max_frames, a.max_prompt_tokens, a.max_samples, a.max_queue,
                    a.request_timeout)  # checked before the engine loads
    if a.max_merged < 1:
        raise ValueError(f"--max-merged must be >= 1, got {a.max_merged}")
    if a.weights_root is not None and not os.path.isdir(a.weights_root):
        raise FileNotFoundError(f"--weights-root {a.weights_root}: no such folder")
    fam = _pipeline_family(a.checkpoint)
    _check_engine_options(a, fam)
    lora = _check_lora(a, fam)
    if a.tp > 1 and a.device.startswith("cuda") and a.device != "cuda":  # rank r takes GPU r
        raise ValueError(f"--tp {a.tp} takes --device cuda (rank r runs on GPU r), not --device {a.device}: "
                         f"choose the GPUs with CUDA_VISIBLE_DEVICES")
    import torch

    if a.tp > 1 and a.device == "cuda" and torch.cuda.device_count() < a.tp:
        raise ValueError(f"--tp {a.tp} needs {a.tp} GPUs, one per rank; {torch.cuda.device_count()} visible")
    _set_threads(a)
    from .server import serve

    serve(*_engine_placement(a, threads=torch.get_num_threads()), host=a.host, port=a.port, limits=limits,
          default_seed=a.seed, weights_root=a.weights_root, lora=lora, max_merged=a.max_merged)
    return 0


VERBS = {
    "init-checkpoint": ("write a tiny diffusers-format checkpoint with seeded random weights", _add_init_checkpoint,
                        _run_init_checkpoint),
    "parity": ("compare the engine's forward with the train side's, bitwise, with a per-layer report", _add_parity,
               _run_parity),
    "generate": ("generate images of one prompt with the rollout engine, optionally with a trained LoRA (PNGs or "
                 "MP4s, settings.json, optional snapshot)", _add_generate, _run_generate),
    "train": ("GRPO training: rollouts, rewards, PPO-clip, LoRA sync, parity at every optimizer step", _add_train,
              _run_train),
    "patches": ("list the patches of a rollout patch group", _add_patches, _run_patches),
    "reward": ("score one image for a prompt with a reward", _add_reward, _run_reward),
    "reward-serve": ("serve a reward over HTTP, batching concurrent requests", _add_reward_serve, _run_reward_serve),
    "serve": ("serve the rollout engine over HTTP: rollouts, OpenAI-style images, weight updates", _add_serve,
              _run_serve),
}
# A name that left a verb because it means something else in another: the hint its refusal gives.
MOVED = {("serve", "--max-batch"): "serve's bound on samples per request is --max-samples (--max-batch is "
                                   "reward-serve's size of a merged reward call)"}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """Every verb; with `verb`, only that verb's options are built (another verb's may import heavy modules: the
    reward registry imports torch), so a bad flag fails at once."""
    parser = Parser(prog="trueflow", description="Online RL for flow-matching diffusion "
                    "transformers, with bitwise train/rollout parity.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name, (help_text, add, _run) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if verb in (None, name):
            add(p)
    return parser


def _one_line_warning(verb: str):
    def format(message, category, filename, lineno, line=None) -> str:
        return f"trueflow {verb}: warning: {' '.join(str(message).split())}\n"

    return format


def main(argv: list[str] | None = None) -> int:
    command_line = argv is None  # the process's own command line, not a call from Python
    argv = sys.argv[1:] if argv is None else list(argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning(verb if verb in VERBS else "")
    try:
        return _main(argv, verb, command_line)
    finally:  # a caller in Python gets its own formatting back
        warnings.formatwarning = formatwarning


def _main(argv: list[str], verb: str | None, command_line: bool) -> int:
    parser = build_parser(verb if verb in VERBS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named with the verb whose --help lists what it takes
        hints = [MOVED[(args.verb, u.partition("=")[0])] for u in unknown if (args.verb, u.partition("=")[0]) in MOVED]
        parser.exit(2, f"trueflow {args.verb}: error: unrecognized arguments: {' '.join(unknown)} "
                       f"({'; '.join(hints) + '; ' if hints else ''}see trueflow {args.verb} --help)\n")
    try:
        code = VERBS[args.verb][2](args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # bad input: one clear line, no traceback
        print(f"trueflow {args.verb}: error: {' '.join(str(e).split())}", file=sys.stderr)
        code = 2
    if command_line and args.verb == "train" and "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_torchrun_worker(code)
    return code


def _exit_torchrun_worker(code: int) -> None:
    """End a torchrun worker whose run is over (its files written and closed, its process group destroyed) without
    interpreter finalization. On 2 CPU ranks under load, a gloo worker thread still holding a finished work item's
    tensors was seen to abort a rank at finalization ("terminate called without an active exception", SIGABRT)
    after a run that had succeeded, turning exit 0 into -6; PyTorch's own analysis (pytorch/pytorch#179291) puts the
    abort in the GIL acquire of that teardown. Nothing is left to do at that point, so skip it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
