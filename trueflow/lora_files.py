"""LoRA files: where a training run keeps them (train/checkpoint.py writes them), and reading one back for an engine
(`generate --lora`, `serve --lora`).

A leaf: a `--lora` path is found and checked against the model family's LoRA targets from the safetensors header
alone (JSON; nothing loads torch), so a wrong file is refused before an engine loads. The tensors are read only
by `load_lora`.

What `--lora PATH` takes:
- a `trueflow train` run folder: its latest complete checkpoint (the one `checkpoints/latest` names);
- a checkpoint folder `RUN/checkpoints/step-N` (complete: it holds `COMPLETE`);
- a folder PEFT's `save_pretrained` wrote (`adapter_model.safetensors` beside `adapter_config.json`);
- a safetensors file of PEFT-format tensors, as diffusers' `save_lora_weights` writes them (`transformer.`-prefixed
  names, rank and alpha in its `lora_adapter_metadata`) or PEFT does (`base_model.model.`-prefixed).
`--ema` picks a checkpoint's EMA twin (`pytorch_lora_weights_ema.safetensors`).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .models.spec import ModelFamily

LORA_FILE = "pytorch_lora_weights.safetensors"
EMA_FILE = "pytorch_lora_weights_ema.safetensors"
DIFFUSERS_PREFIX = "transformer."
COMPLETE = "COMPLETE"  # written last into a checkpoint folder
PEFT_FILE, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's save_pretrained
# diffusers' `LoraBaseMixin.write_lora_layers` stores the adapter config (prefixed `transformer.`) under this key of
# the safetensors metadata (diffusers/loaders/lora_base.py, LORA_ADAPTER_METADATA_KEY).
METADATA_KEY = "lora_adapter_metadata"
HEADER_BYTES = 100 << 20  # safetensors' own bound on a header


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint folders of a run, newest first (the one `latest` names leads)."""
    ckpts = Path(root) / "checkpoints"
    if not ckpts.is_dir():
        return []
    done = sorted((d for d in ckpts.glob("step-*") if (d / COMPLETE).is_file()), reverse=True)
    pointer = ckpts / "latest"
    named = ckpts / pointer.read_text().strip() if pointer.is_file() else None
    return sorted(done, key=lambda d: d != named)  # stable: the named one first, the rest newest first


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint: the one `latest` names, or failing that the newest folder with COMPLETE."""
    done = complete_checkpoints(root)
    return done[0] if done else None


@dataclass(frozen=True)
class LoraFile:
    """A LoRA safetensors file checked against a family: its path, PEFT's scale (alpha / rank) and rank."""

    path: Path
    scale: float
    rank: int
    modules: int  # adapted modules


def resolve_lora(path: str, ema: bool = False, flag: str = "--lora") -> Path:
    """The safetensors file `--lora PATH` names (module docstring), or FileNotFoundError/ValueError in one line."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {path}: no such file or folder")
    if p.is_file():
        if ema:
            raise ValueError(f"--ema picks the EMA file of a checkpoint folder: give {flag} the folder "
                             f"({p.parent}), or the EMA file itself without --ema")
        return p
    if (p / "checkpoints").is_dir():  # a run folder: its latest complete checkpoint
        latest = latest_checkpoint(p)
        if latest is None:
            raise FileNotFoundError(f"{flag} {path}: the run has no complete checkpoint yet (checkpoints/step-N "
                                    f"with {COMPLETE}); name a LoRA file, or wait for the run's first checkpoint")
        p = latest
    _one_expert(p, flag)
    if (p / LORA_FILE).is_file():
        if not (p / COMPLETE).is_file() and p.parent.name == "checkpoints":
            raise ValueError(f"{flag} {p}: an incomplete checkpoint (no {COMPLETE}: it was being written); name "
                             f"the run folder for its latest complete one")
        if ema:
            if not (p / EMA_FILE).is_file():
                raise FileNotFoundError(f"--ema: {p} holds no EMA of the LoRA (the run trained with --ema-decay 0)")
            return p / EMA_FILE
        return p / LORA_FILE
    if (p / PEFT_FILE).is_file() and not ema:
        return p / PEFT_FILE
    raise FileNotFoundError(f"{flag} {path}: no LoRA in this folder (a run folder, a checkpoints/step-N folder "
                            f"holding {LORA_FILE}, a PEFT folder holding {PEFT_FILE}, or a safetensors file)")


def _one_expert(folder: Path, flag: str) -> None:
    """A checkpoint of a run that trained another expert's LoRA (Wan2.2-A14B's transformer_2: its own file) is
    refused: generate and serve load one LoRA file, the first expert's, and would sample a policy never trained."""
    state = folder / "trainer_state.json"
    if not state.is_file():
        return
    try:
        info = json.loads(state.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # the checkpoint's own reader names the damage when the run resumes
    experts: list[str] = info.get("experts", ["transformer"]) if isinstance(info, dict) else ["transformer"]
    trained: list[str] = info.get("lora_experts", experts) if isinstance(info, dict) else experts
    others = [e for e in trained if e != experts[0]]
    if others:
        raise ValueError(f"{flag} {folder}: the run trained the LoRA of {', '.join(others)} too (its own file), and "
                         f"{flag} loads one expert's LoRA (the first's): sampling a run of several trained experts "
                         "is not supported yet; name the first expert's file to sample it alone")


def read_header(path: Path) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(tensor name -> shape, metadata) of a safetensors file, from its header: an 8-byte little-endian length, then
    that many bytes of JSON (the safetensors format; no tensor is read)."""
    bad = ValueError(f"--lora {path}: not a safetensors file (its header does not read)")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > HEADER_BYTES:
                raise bad
            header = json.loads(f.read(n))
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError, OSError):
        raise bad from None
    if not isinstance(header, dict):
        raise bad
    metadata = header.pop("__metadata__", None) or {}
    try:
        shapes = {k: list(v["shape"]) for k, v in header.items()}
    except (TypeError, KeyError):
        raise bad from None
    return shapes, metadata


def _adapter_config(path: Path, metadata: dict[str, str]) -> dict[str, Any]:
    """The adapter's PEFT config: diffusers' metadata in the file (its `transformer.` prefix dropped), else the
    `adapter_config.json` beside it (a trainer checkpoint or a PEFT folder), else none."""
    if METADATA_KEY in metadata:
        try:
            packed = json.loads(metadata[METADATA_KEY])
        except json.JSONDecodeError:
            raise ValueError(f"--lora {path}: its {METADATA_KEY} metadata is not JSON") from None
        return {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in packed.items() if k.startswith(DIFFUSERS_PREFIX)}
    beside = path.parent / PEFT_CONFIG
    if beside.is_file():
        try:
            return json.loads(beside.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"--lora {path}: {beside} is not JSON") from None
    return {}


def _unmappable(family: ModelFamily, checkpoint: str | Path, modules: list[str]) -> list[str]:
    """The LoRA modules (diffusers names) that are no linear layer of the engine the checkpoint builds: the
    family's own name map onto a parameter-free model on the meta device (nothing is allocated or read)."""
    from . import loading
    from .layers.linear import Linear

    model = family.engine.build_model(loading.read_transformer_config(checkpoint), device="meta")
    layers = dict(model.named_modules())
    return [m for m in modules if not isinstance(layers.get(family.engine.map_module_name(m)[0]), Linear)]


def check_lora(path: Path, family: ModelFamily, checkpoint: str | Path) -> LoraFile:
    """`path`'s LoRA checked against `family`'s engine of `checkpoint`, from its header: PEFT-format names of layers
    the engine has (the family's LoRA targets), one rank, and the scale PEFT applies (`lora_alpha / r`, or
    `/ sqrt(r)` with rsLoRA: peft/tuners/lora/layer.py, `update_layer`). Without a config, alpha is the rank (scale
    1), the convention diffusers' loader follows (diffusers/utils/peft_utils.py, `get_peft_kwargs`). One-line
    ValueError on anything the engine cannot take (shapes and values are the engine's own check, on install)."""
    from .models.weight_map import WeightLoadError

    shapes, metadata = read_header(path)
    try:  # the family's own parser of PEFT names, given the shapes in place of the tensors
        pairs = family.engine.parse_peft_state_dict(shapes)
    except WeightLoadError as e:
        names = sorted(e.unexpected + e.missing)
        raise ValueError(f"--lora {path}: {len(names)} name(s) are not PEFT LoRA tensors (<module>.lora_A.weight / "
                         f".lora_B.weight), e.g. {', '.join(names[:3])}") from None
    if not pairs:
        raise ValueError(f"--lora {path}: the file holds no LoRA tensors")
    foreign = sorted(_unmappable(family, checkpoint, list(pairs)))
    if foreign:
        raise ValueError(f"--lora {path}: the {family.name} engine cannot map {len(foreign)} of its {len(pairs)} "
                         f"modules (e.g. {', '.join(foreign[:3])}; its LoRA targets: "
                         f"{', '.join(family.train.lora_targets)}): is it a LoRA of another model?")
    ranks = {a[0] for a, _ in pairs.values() if len(a) == 2}
    config = _adapter_config(path, metadata)
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern") or len(ranks) != 1:
        raise ValueError(f"--lora {path}: a LoRA with one rank and alpha for every module is taken (no DoRA, no "
                         f"rank_pattern/alpha_pattern); this one has ranks {sorted(ranks)}")
    (rank,) = ranks
    r = config.get("r", rank)
    if r != rank:
        raise ValueError(f"--lora {path}: its config says rank {r}, its tensors are rank {rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"--lora {path}: lora_alpha {alpha!r} is not a finite number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraFile(path, float(scale), rank, len(pairs))


def find_lora(path: str, ema: bool, family: ModelFamily, checkpoint: str | Path) -> LoraFile:
    """`--lora PATH [--ema]` resolved and checked against `family`'s engine of `checkpoint` (before it loads)."""
    return check_lora(resolve_lora(path, ema), family, checkpoint)


def load_lora(lora: LoraFile) -> dict[str, torch.Tensor]:
    """The file's tensors (PEFT names as written; the engine's parser takes every prefix)."""
    from safetensors.torch import load_file

    return load_file(str(lora.path))
