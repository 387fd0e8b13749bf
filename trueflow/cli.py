"""`trueflow <verb>`: the command line. Each verb is a function taking parsed arguments."""

from __future__ import annotations

import argparse
import json
import sys

from .options import add_engine_options


# -- init-checkpoint -----------------------------------------------------------------------------------------
def _add_init_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", default="qwen_image", help="model family (default: qwen_image)")
    p.add_argument("--size", default="tiny", help="architecture size written to disk (default: tiny)")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")


def _run_init_checkpoint(a: argparse.Namespace) -> int:
    from .models.qwen_image.checkpoint import init_checkpoint

    path = init_checkpoint(a.out, family=a.family, size=a.size, seed=a.seed, overwrite=a.overwrite)
    print(f"wrote a {a.size} {a.family} checkpoint to {path}")
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


def _run_parity(a: argparse.Namespace) -> int:
    from .parity.probe import ParityProbe, ProbeSpec
    from .parity.report import format_ablation, format_result

    spec = ProbeSpec(checkpoint=a.checkpoint, random_size=a.random_size, batch=a.batch, text_len=a.text_len,
                     resolution=a.resolution, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, dtype=a.dtype,
                     seed=a.seed, device=a.device, lora_merge_mode=a.lora_merge_mode,
                     layer_report=a.layer_report)
    probe = ParityProbe(spec)
    result, engine_output = probe.run(a.patch_group, tuple(a.disable_patch))
    ablation = probe.ablate(a.patch_group) if a.ablate else None
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
        if ablation is not None:
            print(format_ablation(ablation))
    return 0


# -- patches -------------------------------------------------------------------------------------------------
def _add_patches(p: argparse.ArgumentParser) -> None:
    p.add_argument("--patch-group", default="qwen_image", help="group to list (default: qwen_image)")


def _run_patches(a: argparse.Namespace) -> int:
    from .patches import get_group

    group = get_group(a.patch_group)
    for patch in group.patches if group else ():
        print(f"{patch.name:40s} {patch.summary}")
    return 0


VERBS = {
    "init-checkpoint": ("write a tiny diffusers-format checkpoint with seeded random weights", _add_init_checkpoint, _run_init_checkpoint),
    "parity": ("compare the engine's forward with the train side's, bitwise, with a per-layer report", _add_parity, _run_parity),
    "patches": ("list the patches of a rollout patch group", _add_patches, _run_patches),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trueflow", description="Online RL for flow-matching diffusion "
                                     "transformers, with bitwise train/rollout parity.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name, (help_text, add, _run) in VERBS.items():
        add(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return VERBS[args.verb][2](args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear message, no traceback
        print(f"trueflow {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
