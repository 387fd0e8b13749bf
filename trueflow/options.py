"""Command-line options shared by several verbs: one option has one name (and one meaning) everywhere."""

from __future__ import annotations

import argparse

from .dtypes import DTYPES


def add_engine_options(p: argparse.ArgumentParser, default_patch_group: str = "none") -> None:
    """Options of every verb that builds a rollout engine."""
    p.add_argument("--patch-group", default=default_patch_group,
                   help="rollout patch group: 'none' keeps the engine's fast numerics, 'qwen_image' makes them "
                        f"train-exact (default: {default_patch_group})")
    p.add_argument("--disable-patch", action="append", default=[], metavar="NAME",
                   help="switch one patch of the group off (repeatable); see `trueflow patches`")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant parity mode: batch-invariant GEMMs and per-sample attention on both sides, "
                        "so parity holds whatever the batch shapes and text lengths (docs/patch-group.md)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype of both sides (default: bf16)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """Options of every verb that runs the denoise loop."""
    p.add_argument("--steps", type=int, default=10, help="denoising steps (default: 10)")
    p.add_argument("--sampler", choices=("ode", "sde", "cps"), default="sde", help="sampler (default: sde)")
    p.add_argument("--noise-level", type=float, default=0.7, help="SDE/CPS noise level a (default: 0.7)")
    p.add_argument("--cfg-scale", type=float, default=4.0, help="true-CFG scale (default: 4.0)")

