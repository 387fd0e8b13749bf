"""`trueflow <verb>`: the command line. Each verb is a function taking parsed arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from .dtypes import DTYPES, torch_dtype
from .options import add_engine_options, add_sampling_options


# -- init-checkpoint -----------------------------------------------------------------------------------------
def _add_init_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default=None,
                   help="model family, a folder of trueflow/models (default: the default family)")
    p.add_argument("--size", default="tiny", help="architecture size written to disk (default: tiny)")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype the transformer is stored in (default: fp32)")
    p.add_argument("--device", default="cpu", help="where the random weights are drawn (a GPU for --size full)")


def _run_init_checkpoint(a: argparse.Namespace) -> int:
    from .checkpoints import init_checkpoint
    from .models import family_for_checkpoint

    path = init_checkpoint(a.out, family=a.family, size=a.size, seed=a.seed, overwrite=a.overwrite,
                           dtype=torch_dtype(a.dtype), device=a.device)
    print(f"wrote a {a.size} {family_for_checkpoint(path).name} checkpoint to {path}")
    return 0


# -- parity --------------------------------------------------------------------------------------------------
def _add_parity(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="diffusers pipeline folder")
    src.add_argument("--random-size", choices=("tiny", "one_block", "full"),
                     help="an in-memory architecture with seeded random weights instead of a checkpoint")
    add_engine_options(p, default_patch_group="none")
    p.add_argument("--batch", type=int, default=1, help="batch (microgroup) size (default: 1)")
    p.add_argument("--text-len", type=int, default=7, help="text tokens per sample (default: 7)")
    p.add_argument("--train-micro-batch", type=int, default=None, metavar="N",
                   help="run the train side in micro-batches of N samples against the engine's one batch: bitwise "
                        "only in the batch-invariant mode (default: the whole batch, as a microgroup)")
    p.add_argument("--resolution", type=int, default=64, help="image side in pixels (default: 64)")
    p.add_argument("--lora-rank", type=int, default=0, help="add a PEFT LoRA of this rank with non-zero B (default: none)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: the rank)")
    p.add_argument("--lora-merge-mode", choices=("unmerged", "merged"), default=None,
                   help="how the engine takes the LoRA (default: the patch group's choice)")
    p.add_argument("--layer-report", choices=("all", "blocks"), default="all",
                   help="modules compared per layer: all, or whole blocks only (less memory at full size)")
    p.add_argument("--ablate", action="store_true", help="also run with each patch of the group switched off alone")
    p.add_argument("--save", metavar="DIR", help="write inputs, engine output, LoRA and a manifest to DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the engine, one process each "
                   "(docs/tensor-parallel.md; default: 1)")
    p.add_argument("--train-tp-match", type=int, default=None, metavar="N",
                   help="run each sharded layer of the train side as the engine's N ranks do (N = --tp): bitwise "
                        "under TP (default: stock diffusers)")


def _run_parity(a: argparse.Namespace) -> int:
    from .parity.probe import ParityProbe, ProbeSpec
    from .parity.report import format_ablation, format_result

    group = _patch_group(a)
    spec = ProbeSpec(checkpoint=a.checkpoint, random_size=a.random_size, batch=a.batch, text_len=a.text_len,
                     resolution=a.resolution, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, dtype=a.dtype,
                     seed=a.seed, device=a.device, lora_merge_mode=a.lora_merge_mode,
                     layer_report=a.layer_report, batch_invariant=a.batch_invariant,
                     train_micro_batch=a.train_micro_batch)
    if a.tp != 1 or a.train_tp_match is not None:
        from .parity.tp import run_tp_probe

        if a.ablate or a.save:
            raise ValueError("--ablate and --save run at --tp 1; drop them or --tp")
        result, ablation = run_tp_probe(spec, a.tp, a.train_tp_match, group, tuple(a.disable_patch)), None
    else:
        probe = ParityProbe(spec)
        result, engine_output = probe.run(group, tuple(a.disable_patch))
        ablation = probe.ablate(group) if a.ablate else None
        if a.save:
            probe.save(a.save, result, engine_output)
    if a.json:
        out = result.to_json()
        out["layers"] = [vars(r) for r in result.layers]
        if ablation is not None:
            out["ablation"] = [r.to_json(with_layers=False) for r in ablation]
        print(json.dumps(out))
    else:
        print(format_result(spec, result))
        if a.tp != 1 or a.train_tp_match is not None:
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
    p.add_argument("--negative-prompt", default=" ", help="negative prompt of true CFG (default: ' ')")
    p.add_argument("--num-images", type=int, default=1, help="images of the prompt, run as one batch (default: 1)")
    add_sampling_options(p)
    p.add_argument("--resolution", type=int, default=64, help="image side in pixels, a multiple of the family's "
                   "granule (Qwen-Image 16, LTX-2.3 32; default: 64)")
    p.add_argument("--num-frames", type=int, default=1, help="frames per sample: 1 for images; a video family's "
                   "count (LTX-2.3: 8k + 1) writes MP4s and frame strips (default: 1)")
    p.add_argument("--fps", type=float, default=24.0, help="a video's frame rate: what a video family conditions on "
                   "and the MP4s play at (default: 24)")
    add_engine_options(p, default_patch_group="none")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the engine, one process each "
                   "(docs/tensor-parallel.md; default: 1, in this process)")
    p.add_argument("--snapshot", metavar="FILE", help="also write a debug snapshot of every step (docs/snapshot.md)")
    p.add_argument("--out", required=True, help="output folder for the PNGs (or MP4s) and settings.json")


def _run_generate(a: argparse.Namespace) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from PIL import Image

    from .engine.request import RolloutRequest
    from .engine.sampling_params import SamplingParams
    from .engine.snapshot import save_snapshot
    from .placement import build_engine
    from .video import write_mp4, write_strip

    params = SamplingParams(steps=a.steps, sampler=a.sampler, noise_level=a.noise_level, cfg_scale=a.cfg_scale,
                            negative_prompt=a.negative_prompt, height=a.resolution, width=a.resolution,
                            num_frames=a.num_frames, fps=a.fps)
    request = RolloutRequest([a.prompt], a.num_images, params, a.seed, record_snapshot=a.snapshot is not None)
    engine = build_engine(*_engine_placement(a, progress=sys.stderr.isatty()))
    try:
        rollout = engine.rollout(request)
    finally:
        engine.shutdown()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, sample in enumerate(rollout.images):
        if sample.ndim == 4:  # a video [F, H, W, 3]
            write_mp4(sample, out / f"{i:04d}.mp4", params.fps)
            write_strip(sample, out / f"{i:04d}-frames.png")
        else:
            Image.fromarray(sample.numpy()).save(out / f"{i:04d}.png")
    settings = {"prompt": a.prompt, "num_images": a.num_images, "seed": a.seed, "params": asdict(params),
                "engine": rollout.engine, "sde_steps": [mg.sde_steps for mg in rollout.microgroups],
                "snapshot": a.snapshot}
    (out / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    if a.snapshot:
        save_snapshot(rollout, a.snapshot)
    kind = "video(s)" if rollout.images.ndim == 5 else "image(s)"
    print(f"wrote {len(rollout.images)} {kind} and settings.json to {out}" +
          (f", snapshot to {a.snapshot}" if a.snapshot else ""))
    return 0


# -- train -----------------------------------------------------------------------------------------------------
def _add_train(p: argparse.ArgumentParser) -> None:
    from .train.config import add_arguments

    p.set_defaults(train_settings=add_arguments(p))


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"trueflow train: warning: {' '.join(str(message).split())}\n"


def _run_train(a: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .train.config import config_from_args, format_error

    warnings.formatwarning = _one_line_warning
    try:  # types, ranges and combinations: before anything is loaded
        cfg = config_from_args(a, a.train_settings)
    except ValidationError as e:
        raise ValueError(format_error(e)) from None
    if a.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from .ray import RayRunError
    from .rewards.base import RewardError
    from .train.run import run_training

    try:
        if cfg.ray:  # this process is the driver; the Ray actors run `run_training` (docs/scaling.md)
            from .ray.launch import run_ray

            out = run_ray(cfg)
        else:
            out = run_training(cfg)
    except RayRunError as e:  # an actor died or a rank failed: one line naming it
        print(f"trueflow train: error: {e}", file=sys.stderr)
        return 1
    except RewardError as e:  # the user's reward failed: the run stops, its last checkpoint intact
        raise ValueError(f"{e} (the run stopped; its last checkpoint is intact: fix the reward and --resume, or "
                         "--reward-on-error skip to drop failing prompt groups)") from None
    except KeyboardInterrupt:  # Ctrl-C: what was written stays; the run resumes from its last checkpoint
        print("trueflow train: interrupted (--resume continues from the last checkpoint)", file=sys.stderr)
        return 130
    if out is not None:
        print(f"run written to {out} (metrics.jsonl, summary.md, samples/, checkpoints/)")
    return 0


# -- patches -------------------------------------------------------------------------------------------------
def _add_patches(p: argparse.ArgumentParser) -> None:
    p.add_argument("--patch-group", default=None, help="group to list (default: the default family's first group)")


def _run_patches(a: argparse.Namespace) -> int:
    from .models import default_family
    from .patches import get_group

    group = get_group(a.patch_group or next(iter(default_family().patch_groups)))
    for patch in group.patches if group else ():
        print(f"{patch.name:40s} {patch.summary}")
    return 0


# -- reward --------------------------------------------------------------------------------------------------
_REWARD_SPEC_HELP = ("a registered reward ({names}), a weighted sum 'name:w,name2:w2', a custom 'my.module:function' "
                     "or a reward server URL")


def _add_reward_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="model folder of the rewards that take one (pickscore: "
                   "MODEL_DIR or MODEL_DIR:PROCESSOR_DIR)")
    p.add_argument("--device", default="cpu", help="torch device of model rewards, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--url", metavar="URL", help="URL of the rewards that take one (vlm_judge: an OpenAI-compatible "
                   "chat server, e.g. http://127.0.0.1:8080/v1)")


def _add_reward(p: argparse.ArgumentParser) -> None:
    from .rewards import REWARDS

    p.add_argument("--name", required=True, metavar="SPEC", help=_REWARD_SPEC_HELP.format(names=", ".join(REWARDS)))
    _add_reward_model_options(p)
    p.add_argument("--image", required=True, metavar="PNG", help="image file (any format PIL reads)")
    p.add_argument("--prompt", required=True, help="the prompt the image was generated for")


def _run_reward(a: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from PIL import Image

    from .rewards import RewardError, build_reward, score

    with Image.open(a.image) as image:
        pixels = torch.from_numpy(np.array(image.convert("RGB")))[None]
    try:
        scores, _ = score(build_reward(a.name, a.model, a.device, url=a.url), pixels, [a.prompt])
    except RewardError as e:
        print(f"trueflow reward: error: {e}", file=sys.stderr)
        return 1
    print(repr(scores[0].item()))
    return 0


# -- reward-serve --------------------------------------------------------------------------------------------
def _add_reward_serve(p: argparse.ArgumentParser) -> None:
    from .rewards import REWARDS

    p.add_argument("--reward", required=True, metavar="SPEC", help=_REWARD_SPEC_HELP.format(names=", ".join(REWARDS)))
    _add_reward_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--max-batch", type=int, default=64, help="images per merged reward call (default: 64)")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="how long the first request waits for others to batch with (default: 5)")


def _run_reward_serve(a: argparse.Namespace) -> int:
    from .rewards.server import serve

    serve(a.reward, host=a.host, port=a.port, model_path=a.model, device=a.device, max_batch=a.max_batch,
          max_wait_ms=a.max_wait_ms, url=a.url)
    return 0


# -- serve ---------------------------------------------------------------------------------------------------
def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="diffusers pipeline folder")
    add_engine_options(p, default_patch_group="none")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; IPC weight updates are "
                   "taken from loopback clients only)")
    p.add_argument("--port", type=int, default=8001, help="port (default: 8001; reward-serve's is 8000)")
    p.add_argument("--threads", type=int, default=None, help="intra-op CPU threads of the engine; on CPU match the "
                   "trainer's for bitwise parity (default: torch's default)")
    p.add_argument("--weights-root", default=None, metavar="DIR", help="folder whose safetensors files and "
                   "checkpoints weight updates may name by path (default: none; path updates are refused)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the engine, one process each (on CUDA "
                   "rank r on GPU r; docs/tensor-parallel.md; default: 1, in this process)")
    p.add_argument("--max-merged", type=int, default=8, metavar="N", help="with --batch-invariant: most rollouts run "
                   "at once with their forwards merged into one batch (default: 8)")
    # The defaults are `server.Limits`' (a test keeps them equal; importing it here would load torch).
    for flags, dest, kind, default, what in [
            (("--max-steps",), "max_steps", int, 100, "most denoising steps per sample"),
            (("--max-pixels",), "max_pixels", int, 2048 * 2048, "most pixels (height x width) of one image frame"),
            (("--max-frames",), "max_frames", int, 1, "most frames per sample (image families make 1)"),
            (("--max-prompt-tokens",), "max_prompt_tokens", int, 1024, "most tokens of a prompt or negative prompt"),
            (("--max-samples", "--max-batch"), "max_samples", int, 64, "most samples (prompts x n) per request"),
            (("--max-queue",), "max_queue", int, 16,
             "most engine calls a generation request may find waiting (more: 503)"),
            (("--request-timeout",), "request_timeout", float, 3600.0,
             "seconds a generation request may take, queue included, before its rollout stops (504)")]:
        p.add_argument(*flags, dest=dest, type=kind, default=default, metavar="N" if kind is int else "SECONDS",
                       help=f"{what} (default: {default})")


def _run_serve(a: argparse.Namespace) -> int:
    import torch

    from .server import Limits, serve

    limits = Limits(a.max_steps, a.max_pixels, a.max_frames, a.max_prompt_tokens, a.max_samples, a.max_queue,
                    a.request_timeout)  # checked before the engine loads
    if a.max_merged < 1:
        raise ValueError(f"--max-merged must be >= 1, got {a.max_merged}")
    if a.weights_root is not None and not os.path.isdir(a.weights_root):
        raise FileNotFoundError(f"--weights-root {a.weights_root}: no such folder")
    if a.tp > 1 and a.device.startswith("cuda"):  # rank r takes GPU r
        if a.device != "cuda":
            raise ValueError(f"--tp {a.tp} takes --device cuda (rank r runs on GPU r), not --device {a.device}: "
                             f"choose the GPUs with CUDA_VISIBLE_DEVICES")
        if torch.cuda.device_count() < a.tp:
            raise ValueError(f"--tp {a.tp} needs {a.tp} GPUs, one per rank; {torch.cuda.device_count()} visible")
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    # --seed: the seed of OpenAI-style requests that name none (rollout requests always carry their own)
    serve(*_engine_placement(a, threads=torch.get_num_threads()), host=a.host, port=a.port, limits=limits,
          default_seed=a.seed, weights_root=a.weights_root, max_merged=a.max_merged)
    return 0


def _patch_group(a: argparse.Namespace) -> str:
    """`--patch-group`, in the batch-invariant mode's form with `--batch-invariant`."""
    from .patches import batch_invariant_group

    return batch_invariant_group(a.patch_group) if a.batch_invariant else a.patch_group


def _engine_placement(a: argparse.Namespace, **spec: object) -> tuple:
    """(EngineSpec, Placement) of a verb's engine options: in this process, or over `--tp` processes of its own."""
    from .placement import EngineSpec, Placement

    engine = EngineSpec(a.checkpoint, _patch_group(a), tuple(a.disable_patch), a.dtype, a.device, **spec)
    return engine, Placement("process" if a.tp > 1 else "local", tp=a.tp)


VERBS = {
    "init-checkpoint": ("write a tiny diffusers-format checkpoint with seeded random weights", _add_init_checkpoint, _run_init_checkpoint),
    "parity": ("compare the engine's forward with the train side's, bitwise, with a per-layer report", _add_parity, _run_parity),
    "generate": ("generate images of one prompt with the rollout engine (PNGs, settings.json, optional snapshot)", _add_generate, _run_generate),
    "train": ("GRPO training: rollouts, rewards, PPO-clip, LoRA sync, parity at every optimizer step", _add_train, _run_train),
    "patches": ("list the patches of a rollout patch group", _add_patches, _run_patches),
    "reward": ("score one image for a prompt with a reward", _add_reward, _run_reward),
    "reward-serve": ("serve a reward over HTTP, batching concurrent requests", _add_reward_serve, _run_reward_serve),
    "serve": ("serve the rollout engine over HTTP: rollouts, OpenAI-style images, weight updates", _add_serve, _run_serve),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported as one line (the usage is one `--help` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """Every verb; with `verb`, only that verb's options are built (another verb's may import heavy modules: the
    reward registry imports torch), so a bad flag fails at once."""
    parser = _Parser(prog="trueflow", description="Online RL for flow-matching diffusion "
                     "transformers, with bitwise train/rollout parity.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name, (help_text, add, _run) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if verb in (None, name):
            add(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    command_line = argv is None  # the process's own command line, not a call from Python
    argv = sys.argv[1:] if argv is None else list(argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(verb if verb in VERBS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named with the verb whose --help lists what it takes
        parser.exit(2, f"trueflow {args.verb}: error: unrecognized arguments: {' '.join(unknown)} "
                       f"(see trueflow {args.verb} --help)\n")
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
