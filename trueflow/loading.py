"""Reading checkpoints from disk: a diffusers pipeline folder (or its transformer/ subfolder).

The only file I/O on the load path; models receive plain dicts of tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(FileNotFoundError):
    pass


def transformer_dir(checkpoint: str | Path) -> Path:
    """The folder holding the transformer's config.json: `checkpoint/transformer` or `checkpoint` itself."""
    root = Path(checkpoint)
    for d in (root / "transformer", root):
        if (d / "config.json").is_file():
            return d
    raise CheckpointError(f"no transformer config in {root} (looked for transformer/config.json and config.json); "
                          f"make a tiny checkpoint with `trueflow init-checkpoint --size tiny --out DIR`")


def read_transformer_config(checkpoint: str | Path) -> dict:
    return json.loads((transformer_dir(checkpoint) / "config.json").read_text())


def read_transformer_state_dict(checkpoint: str | Path,
                                drops: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the transformer, from one safetensors file or the shards an index names; those `drops` names
    are left unread."""
    d = transformer_dir(checkpoint)
    index = d / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise CheckpointError(f"{d}: shard(s) named in {index.name} are missing: {', '.join(missing)}")
        files = [d / s for s in shards]
    else:
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no *.safetensors weights next to config.json")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as sf:
                state.update({k: sf.get_tensor(k) for k in sf.offset_keys() if drops is None or not drops(k)})
        except Exception as e:  # a truncated or corrupt file: name it
            raise CheckpointError(f"{f}: cannot read safetensors ({e}); the file is partial or corrupt") from e
    return state
