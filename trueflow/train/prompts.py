"""Prompts of a training run: a text file (one per line) or the embedded demo set."""

from __future__ import annotations

from pathlib import Path

DEMO_PROMPTS = (
    "a red cube on a wooden table",
    "a lighthouse at dusk",
    "a bowl of ripe cherries",
    "a fox in the snow",
    "a sign that says \"hello\"",
    "a sunset over the sea",
    "a vintage red car",
    "a field of poppies",
)


def load_prompts(path: str | None) -> list[str]:
    if path is None:
        return list(DEMO_PROMPTS)
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    prompts = [line for line in lines if line]
    if not prompts:
        raise ValueError(f"{path}: no prompts (one per line, blank lines ignored)")
    return prompts
