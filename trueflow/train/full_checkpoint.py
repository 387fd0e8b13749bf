"""Checkpoints of a full-parameter run: sharded `torch.distributed.checkpoint` (DCP) folders, written atomically,
resumed bit for bit, on another number of ranks too (DCP reshards on load).

Layout of `OUTPUT_DIR/checkpoints/step-000012/`:
  dcp/                 DCP: every rank's shards of the fp32 masters (`model`), of the optimizer state (`optim`: the
                       moments, sharded as the masters) and of the EMA (`ema`, with --ema-decay), and rank 0's
                       `.metadata`; a checkpoint of R ranks loads on any other number
  transformer/         the transformer in the compute dtype (bf16), a diffusers model folder (config.json and
                       diffusion_pytorch_model.safetensors): `QwenImageTransformer2DModel.from_pretrained(dir)`
                       loads exactly the weights the engine ran; each other expert in its sub-folder
                       (`transformer_2/`), as the pipeline lays them out
  state.pt             the lr scheduler's state and the RNG states (plain values and tensors: weights_only)
  trainer_state.json   step, rollout, metrics lines written, settings, `full: true`, the world size that wrote it
  COMPLETE             written last
The folder is built as `.tmp-step-N` (every rank writes its shards into it) and renamed into place by rank 0 after
every file is fsynced, then `latest` is switched: the same protocol as a LoRA checkpoint's (`checkpoint`), with its
pruning (`--keep-checkpoints`), its leftover removal and its one-line write errors.

Bitwise on another world size: DCP puts each element back where it was, and AdamW's moments and the EMA are
elementwise, so the state resumes exactly. The step that follows is another matter: its gradient sums the micro-
batches' gradients, each rank its own, then the ranks' sums (FSDP2's reduce-scatter), and fp32 addition is not
associative. With at most two micro-batches per step in all (one per rank on 2 ranks, both on 1) the two orders
are the same sum, so the continued run is bitwise; with more, the last bits differ, and so do they when gradient
clipping acts (its norm sums the shards' squares per rank first). `restore` warns when the world size changed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ..files import publish
from ..models.spec import ModelFamily
from . import checkpoint as ckpt
from .dist import DistContext, all_gather_object, all_reduce
from .full import named_weights
from .policy import optimizer_module
from .schedule import WeightsEMA

if TYPE_CHECKING:
    from .model import DiffusersTransformer

DCP_DIR = "dcp"
STATE_FILE = "state.pt"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


def _sharded_state(models: Mapping[str, nn.Module], optimizer: torch.optim.Optimizer,
                   ema: WeightsEMA | None) -> dict:
    module = optimizer_module(models)
    state = {"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, optimizer)}
    if ema is not None:
        state["ema"] = {name: ema.sharded(name) for name in ema.shadow}
    return state


def _local_bytes(state) -> int:
    return ckpt.payload_bytes(*[v.to_local() if hasattr(v, "to_local") else v for v in _tensors(state)])


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)


def save(family: ModelFamily, root: Path, ctx: DistContext, models: Mapping[str, DiffusersTransformer],
         optimizer: torch.optim.Optimizer, scheduler, ema: WeightsEMA | None, dtype: torch.dtype, step: int,
         rollout: int, metrics_lines: int | None, config: dict) -> None:
    """A checkpoint at `step` (the module's layout); every rank takes part. A write error raises
    CheckpointWriteError on every rank, with the folder as it was before."""
    ckpts = root / "checkpoints"
    final, tmp = ckpts / f"step-{step:06d}", ckpts / f"{ckpt.TMP_PREFIX}step-{step:06d}"
    state = _sharded_state(models, optimizer, ema)
    export_bytes = sum(p.numel() for p in named_weights(models).values()) * dtype.itemsize
    needed = int(all_reduce({"b": _local_bytes(state)}, dist.ReduceOp.SUM)["b"]) + export_bytes
    failure = None
    if ctx.is_main:
        ckpt.remove_leftovers(ckpts)  # a killed save's shards would hold their share of the disk
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            failure = _failure(ckpts, final, e, needed)
    failure = all_gather_object(failure)[0]  # also the barrier: the folder exists before any rank writes
    if failure is None:
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp / DCP_DIR, sync_files=True))
            _export(family, models, dtype, tmp, ctx.is_main)
        except Exception as e:  # noqa: BLE001 - a full disk, any write error: reported as one line below
            failure = _failure(ckpts, final, e, needed)
        failures = all_gather_object(failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is None and ctx.is_main:
        renamed = False
        try:
            torch.save({"rng": ckpt.rng_state(), "scheduler": scheduler.state_dict()}, tmp / STATE_FILE)
            sizes = _sizes(tmp, list(models))
            trainer_state = {"step": step, "rollout": rollout, "metrics_lines": metrics_lines, "config": config,
                             "full": True, "world_size": ctx.world, "experts": list(models), **sizes}
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
            (tmp / "COMPLETE").write_text("ok\n")
            publish(tmp)  # the export as readable as the rest (safetensors writes 0600)
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            renamed = True
            ckpt._atomic_write_text(ckpts / "latest", final.name + "\n")
        except Exception as e:  # noqa: BLE001 - as a LoRA checkpoint: `latest` still names the previous one
            if renamed:
                shutil.rmtree(final, ignore_errors=True)
            failure = _failure(ckpts, final, e, needed)
    if failure is not None and ctx.is_main:
        ckpt.remove_leftovers(ckpts)
    failure = all_gather_object(failure)[0]
    if failure is not None:
        raise ckpt.CheckpointWriteError(failure)
    if ctx.is_main:
        print(f"checkpoint {final}: {sizes['size_bytes']:,} bytes ({sizes['dcp_bytes']:,} in the sharded state of "
              f"{ctx.world} rank(s), {sizes['export_bytes']:,} in the bf16 diffusers export)", file=sys.stderr,
              flush=True)
        if config.get("keep_checkpoints"):
            ckpt.prune(root, config["keep_checkpoints"])


def _sizes(folder: Path, experts: list[str]) -> dict[str, int]:
    """The bytes of a checkpoint's files (those written so far: all but trainer_state.json and COMPLETE, a few
    hundred bytes): in all, its DCP shards and metadata, its diffusers export."""

    def size(files) -> int:
        return sum(f.stat().st_size for f in files if f.is_file())

    export = size(folder / e / WEIGHTS_FILE for e in experts)
    return {"size_bytes": size(folder.rglob("*")), "dcp_bytes": size((folder / DCP_DIR).rglob("*")),
            "export_bytes": export}


def _failure(ckpts: Path, final: Path, e: BaseException, needed: int) -> str:
    return ckpt._write_failure(ckpts, final.name, " ".join(f"{type(e).__name__}: {e}".split()),
                               getattr(e, "errno", None), needed)


def _fsync_tree(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


@torch.no_grad()
def _export(family: ModelFamily, models: Mapping[str, DiffusersTransformer], dtype: torch.dtype, folder: Path,
            writes: bool) -> None:
    """Each expert's whole transformer in `dtype` as a diffusers model folder `folder/<expert>/` (a collective: one
    expert gathered at a time; rank 0 writes)."""
    from safetensors.torch import save_file

    for expert, model in models.items():
        weights = {}
        for name, p in model.named_parameters():
            local = p.to(dtype, copy=True)
            full = local.full_tensor() if hasattr(local, "full_tensor") else local
            if writes:
                weights[name] = full.cpu().contiguous()
        if writes:
            (folder / expert).mkdir()
            model.save_config(folder / expert)
            save_file(weights, str(folder / expert / WEIGHTS_FILE), metadata={"format": "pt"})
        del weights


def read(path: Path, state: dict) -> dict:
    """What a checkpoint folder holds besides its DCP shards (which `restore` loads into the built models): the
    scheduler and RNG states. CheckpointError if a file is missing or damaged."""
    missing = [f for f in (STATE_FILE, f"{DCP_DIR}/.metadata") if not (path / f).is_file()]
    missing += [f"{e}/{WEIGHTS_FILE}" for e in state.get("experts", ["transformer"])
                if not (path / e / WEIGHTS_FILE).is_file()]
    if missing:
        raise ckpt.CheckpointError(f"checkpoint {path} is incomplete (missing {', '.join(missing)})")
    try:
        return torch.load(path / STATE_FILE, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the damage, the folder cannot be resumed from
        raise ckpt._unreadable(path, e) from None


def restore(resumed: tuple[Path, None, dict, dict], models: Mapping[str, nn.Module],
            named_params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer, scheduler,
            ema: WeightsEMA | None) -> dict:
    """Load a checkpoint into the built (sharded) models, the optimizer, the EMA, the lr scheduler and the RNGs, on
    this run's world size (DCP reshards); return the saved trainer state. Warns when the world size differs."""
    path, _, extra, state = resumed
    module = optimizer_module(models)
    weights: dict[str, dict[str, Any]] = {"model": get_model_state_dict(module)}
    if ema is not None:
        if not (path / DCP_DIR / ".metadata").is_file() or "ema" not in _saved_keys(path):
            raise ValueError(f"--resume: {path} holds no EMA; resume with the run's --ema-decay (0), or start a "
                             "new --output-dir")
        weights["ema"] = {name: ema.sharded(name) for name in ema.shadow}
    dcp.load(weights, storage_reader=dcp.FileSystemReader(path / DCP_DIR))  # strict: every weight must be there
    set_model_state_dict(module, weights["model"])
    if ema is not None:
        for name, value in weights["ema"].items():
            ema.load_(name, value)
    # A weight that never gets a gradient (Qwen-Image's last text-stream outputs feed nothing) has no optimizer
    # state in the checkpoint, as in the run that saved it: the optimizer's is loaded partially.
    optim = {"optim": get_optimizer_state_dict(module, optimizer)}
    dcp.load(optim, storage_reader=dcp.FileSystemReader(path / DCP_DIR),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    set_optimizer_state_dict(module, optimizer, optim["optim"])
    scheduler.load_state_dict(extra["scheduler"])
    ckpt.set_rng_state(extra["rng"])
    saved_world, world = state.get("world_size"), dist.get_world_size()
    if saved_world != world:
        warnings.warn(f"--resume on {world} rank(s) of a checkpoint {saved_world} rank(s) wrote: the weights, moments "
                      "and EMA resume exactly (DCP reshards them), but a step's gradient then sums its micro-batches' "
                      "in another order, so the run continues bit for bit only with at most two micro-batches per "
                      "step in all and no gradient clipping at work (docs/training.md, Full-parameter checkpoints)",
                      stacklevel=2)
    return state


def _saved_keys(path: Path) -> set[str]:
    """The top-level keys a DCP folder holds (`model`, `optim`, `ema`)."""
    metadata = dcp.FileSystemReader(path / DCP_DIR).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}

