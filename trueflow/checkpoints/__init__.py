"""Checkpoints made by the project: diffusers-format pipeline folders with seeded random weights, written by each
model family's own checkpoint writer (nothing can be downloaded, so tests and benchmarks make their own).
Train side only: engine code never imports this package."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..files import publish


def init_checkpoint(
    out: str | Path, family: str | None = None, size: str = "tiny", seed: int = 0, overwrite: bool = False,
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> Path:
    """Write a diffusers-format pipeline folder of `family` (default: the default family) at `out`.

    `size` is one of the family's transformer presets; `dtype`/`device` are those the transformer's random
    weights are drawn and stored in (a full size is tens of GB: draw it on a GPU). The folder is built next to
    `out` and moved into place at the end, so `out` is never left half-written.
    """
    from ..models import default_family, get_family

    fam = get_family(family) if family is not None else default_family()
    fam.presets.transformer_config(size)  # unknown names fail with the list of all presets
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        fam.presets.write_checkpoint(tmp, size, seed, dtype, device)
        publish(tmp)  # safetensors writes its weight files 0600
        if out.is_dir() and any(out.iterdir()):
            # os.replace cannot overwrite a non-empty directory: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
