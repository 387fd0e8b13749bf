"""Command-line options shared by several verbs: one option has one name (and one meaning) everywhere.

Every verb's parser is built here (`parser`): no prefix matching (`--num-rollout 2` is not `--num-rollouts 2`), and a
renamed option keeps its old name as a hidden alias that warns once (`add_renamed`). tests/test_cli_vocabulary.py
walks every verb's parser and fails on a name that means two things. Nothing here imports torch: a verb's choices,
files and folders are checked before anything heavy loads (tests/test_startup.py).
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from .dtypes import DTYPES


class RenamedFlagWarning(UserWarning):
    """A flag given by its old name (it still works)."""


_WARNED: set[str] = set()  # old names already warned about in this process


class _Renamed(argparse._StoreAction):
    """A store action whose `old_names` still set it, with one warning per old name and process."""

    def __init__(self, option_strings: list[str], dest: str, old_names: tuple[str, ...] = (), **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.old_names = old_names

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.old_names and option_string not in _WARNED:
            _WARNED.add(option_string)
            warnings.warn(f"{option_string} is the old name of {self.option_strings[0]}; use "
                          f"{self.option_strings[0]} (the old name still works)", RenamedFlagWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


class _Formatter(argparse.HelpFormatter):
    """Help without the old names of renamed options (they still parse), and wider columns."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=118)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        old = getattr(action, "old_names", ())
        if not old:
            return super()._format_action_invocation(action)
        shown = argparse.Action([s for s in action.option_strings if s not in old], action.dest, action.nargs,
                                metavar=action.metavar)
        return super()._format_action_invocation(shown)


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching, with a bad flag reported as one line (the usage is one `--help` away)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_renamed(p: argparse.ArgumentParser, name: str, *old_names: str, **kwargs: Any) -> argparse.Action:
    """`name`, also taken under `old_names` (hidden from the help; each warns once when used)."""
    return p.add_argument(name, *old_names, action=_Renamed, old_names=old_names, **kwargs)


def add_output_dir(p: argparse.ArgumentParser, help: str, *old_names: str, required: bool = True) -> None:
    add_renamed(p, "--output-dir", *old_names, required=required, default=None, metavar="DIR", help=help)


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op CPU threads (torch.set_num_threads); on CPU parity needs the same count on both "
                        "sides (condition 9) (default: torch's)")


def add_engine_options(p: argparse.ArgumentParser, seed: int | None = 0,
                       seed_help: str = "random seed (default: 0)") -> None:
    """Options of every verb that builds a rollout engine (the patch group is the checkpoint family's parity group
    unless given: `models.patch_group_for`)."""
    p.add_argument("--patch-group", default=None, metavar="GROUP",
                   help="rollout patch group: the checkpoint family's parity group (qwen_image, ltx) makes the "
                        "engine train-exact; 'none' keeps its fast numerics (default: the family's parity group)")
    p.add_argument("--disable-patch", action="append", default=[], metavar="NAME",
                   help="switch one patch of the group off (repeatable); see `trueflow patches`")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant parity mode: batch-invariant GEMMs and per-sample attention on both sides, "
                        "so parity holds whatever the batch shapes and text lengths (docs/patch-group.md; default: "
                        "off)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype (default: bf16)")
    p.add_argument("--seed", type=int, default=seed, help=seed_help)
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    add_threads(p)


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """Options of every verb that runs the denoise loop."""
    p.add_argument("--steps", type=int, default=10, metavar="N", help="denoising steps (default: 10)")
    p.add_argument("--sampler", choices=("ode", "sde", "cps"), default="sde", help="sampler (default: sde)")
    p.add_argument("--noise-level", type=float, default=0.7, metavar="A",
                   help="SDE/CPS noise level a (default: 0.7)")
    p.add_argument("--cfg-scale", type=float, default=4.0, metavar="S", help="true-CFG scale, 1: no guidance "
                   "(default: 4.0)")
    p.add_argument("--cfg-scale-2", type=float, default=None, metavar="S",
                   help="CFG scale of the experts after the first (Wan2.2's guidance_scale_2; default: --cfg-scale)")
    p.add_argument("--distilled-guidance-scale", type=float, default=None, metavar="S",
                   help="a guidance-distilled model's scale input (FLUX.1-dev's guidance_scale; default: the family's)")


def add_size_options(p: argparse.ArgumentParser, default: int = 64) -> None:
    """`--resolution` (a square side) or `--height`/`--width`, in pixels."""
    p.add_argument("--resolution", type=int, default=None, metavar="PX",
                   help=f"image side in pixels, a multiple of the family's granule (Qwen-Image 16, LTX-2.3 32) "
                        f"(default: {default})")
    p.add_argument("--height", type=int, default=None, metavar="PX", help="image height in pixels (default: "
                   "--resolution)")
    p.add_argument("--width", type=int, default=None, metavar="PX", help="image width in pixels (default: "
                   "--resolution)")
    p.set_defaults(default_resolution=default)


def add_reward_options(p: argparse.ArgumentParser, reward_names: str, required: bool) -> None:
    """The reward and its model, device and URL, under `trueflow train`'s names (`--reward`, `--reward-model`,
    `--reward-url`)."""
    add_renamed(p, "--reward", "--name", required=required, metavar="SPEC",
                help=f"a registered reward ({reward_names}), a weighted sum 'name:w,name2:w2', a custom "
                     f"'my.module:function' or a reward server URL")
    add_renamed(p, "--reward-model", "--model", default=None, metavar="PATH",
                help="model folder of the rewards that take one (pickscore: MODEL_DIR or MODEL_DIR:PROCESSOR_DIR)")
    add_renamed(p, "--reward-url", "--url", default=None, metavar="URL",
                help="URL of the rewards that take one (vlm_judge: an OpenAI-compatible chat server, e.g. "
                     "http://127.0.0.1:8080/v1)")
    p.add_argument("--device", default="cpu", help="torch device of model rewards, e.g. cpu or cuda (default: cpu)")
    add_threads(p)


def add_lora_options(p: argparse.ArgumentParser) -> None:
    """A trained LoRA to sample with (`lora_files.resolve_lora`)."""
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a LoRA to load: a `trueflow train` run folder (its latest complete checkpoint), one of its "
                        "checkpoints/step-N folders, or a PEFT/diffusers LoRA safetensors file (default: none)")
    p.add_argument("--ema", action="store_true", help="with --lora DIR: the checkpoint's EMA twin of the LoRA "
                   "(pytorch_lora_weights_ema.safetensors)")


def size_of(a: argparse.Namespace) -> tuple[int, int, str, str]:
    """(height, width, height's flag, width's flag) as given: `--height`/`--width` win over `--resolution`, which
    defaults to the verb's default; the flags are the names an error should quote."""
    side = a.resolution if a.resolution is not None else a.default_resolution
    side_flag = f"--resolution {side}"
    h_flag = f"--height {a.height}" if a.height is not None else side_flag
    w_flag = f"--width {a.width}" if a.width is not None else side_flag
    return (a.height if a.height is not None else side), (a.width if a.width is not None else side), h_flag, w_flag
