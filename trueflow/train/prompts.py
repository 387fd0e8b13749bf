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
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts {path}: " + ("a folder; name a text file, one prompt per line" if p.is_dir()
                                                  else "no such file (a text file, one prompt per line)"))
    try:
        lines = [line.strip() for line in p.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {path}: not UTF-8 text (a text file, one prompt per line)") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts (one per line, blank lines ignored)")
    return prompts
