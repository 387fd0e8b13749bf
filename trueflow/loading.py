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


def transformer_dir(checkpoint: str | Path, subfolder: str = "transformer") -> Path:
    """The folder holding a transformer's config.json: `checkpoint/<subfolder>` (an expert's pipeline component,
    `transformer` by default), or for the default `checkpoint` itself (a bare transformer folder)."""
    root = Path(checkpoint)
    for d in (root / subfolder, root) if subfolder == "transformer" else (root / subfolder,):
        if (d / "config.json").is_file():
            return d
    raise CheckpointError(f"no transformer config in {root} (looked for {subfolder}/config.json"
                          + (" and config.json" if subfolder == "transformer" else "") + "); make a tiny checkpoint "
                          "with `trueflow init-checkpoint --size tiny --out DIR`")


def read_transformer_config(checkpoint: str | Path, subfolder: str = "transformer") -> dict:
    return json.loads((transformer_dir(checkpoint, subfolder) / "config.json").read_text())


def read_transformer_state_dict(checkpoint: str | Path, drops: Callable[[str], bool] | None = None,
                                subfolder: str = "transformer") -> dict[str, torch.Tensor]:
    """All tensors of a transformer (the pipeline component `subfolder`), from one safetensors file or the shards
    an index names; those `drops` names are left unread."""
    d = transformer_dir(checkpoint, subfolder)
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
