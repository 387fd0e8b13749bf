"""Files a person reads are readable as any file they make is: safetensors writes its files 0600 (owner only), where
`open()` gives 0666 less the umask (0644 by default), so each writer of a safetensors file calls `publish` after."""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


def publish(*paths: str | Path) -> None:
    """Give `paths` (files, or every file under a folder) the mode `open()` gives a new file."""
    mode = 0o666 & ~_umask()
    for p in map(Path, paths):
        for f in (p.rglob("*") if p.is_dir() else [p]):
            if f.is_file() and not f.is_symlink():
                f.chmod(mode)
