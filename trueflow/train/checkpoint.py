"""Training checkpoints, written atomically, resumed exactly.

Layout of `OUTPUT_DIR/checkpoints/step-000012/`:
  pytorch_lora_weights.safetensors  the LoRA masters in fp32, PEFT names with diffusers' `transformer.` prefix —
                                    the family's pipeline (`QwenImagePipeline`) `.load_lora_weights(dir)` loads it
                                    (cast to the pipeline's dtype)
  pytorch_lora_weights_ema.safetensors  with --ema-decay: the EMA of the LoRA, same format
                                    (`load_lora_weights(dir, weight_name="pytorch_lora_weights_ema.safetensors")`)
  adapter_config.json               rank, alpha, target modules (PEFT's LoraConfig)
  optimizer.pt                      the optimizer's full (unsharded) state dict, the lr scheduler's, the RNG states;
                                    with --async-rollouts also the LoRA masters (fp32) of the weight versions that
                                    make the rollouts in flight (`train.async_rollouts`)
  trainer_state.json                step, rollout, metrics lines written, RNG states, settings
  COMPLETE                          written last; a folder without it is ignored on resume
A family of several experts (Wan2.2-A14B: `transformer`, `transformer_2`) writes the first expert's LoRA as above
and each other trained expert's as `pytorch_lora_weights_<expert>.safetensors` (EMA:
`pytorch_lora_weights_ema_<expert>.safetensors`), each in the same format, `transformer.`-prefixed, as the
pipeline's `save_lora_weights` writes one transformer's: `WanPipeline.load_lora_weights(dir)` loads the first,
`load_lora_weights(dir, weight_name="pytorch_lora_weights_transformer_2.safetensors",
load_into_transformer_2=True)` the second (diffusers' `WanLoraLoaderMixin`). Such a checkpoint's
trainer_state.json also names the `experts` (in order) and the `lora_experts` trained; a one-expert checkpoint
is exactly as before experts existed.
A checkpoint is built in `.tmp-step-N` and renamed into place (os.replace is atomic on one file system), then
`latest` is rewritten the same way. A run killed at any moment leaves the previous checkpoint intact (and perhaps a
`.tmp-*` folder, which the next save removes before it writes); a checkpoint damaged later (e.g. a truncated file)
is skipped on resume, with a warning, for the one before it. A save that fails (a full disk) removes what it wrote
and raises CheckpointWriteError, one line naming the folder, the bytes it needs and those free. `keep` > 0 prunes
older complete checkpoints after each save; the latest is never pruned.
`optimizer.pt` holds tensors and plain values only, and is read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file

from ..files import publish
from ..lora_files import (COMPLETE, DIFFUSERS_PREFIX, EMA_FILE, LORA_FILE, complete_checkpoints,  # noqa: F401 - re-exported
                          latest_checkpoint)
from ..models.spec import ModelFamily, expert_prefix, split_by_expert
from .dist import DistContext, all_gather_object
from .model import LoraSpec
from .policy import lora_full_state, optimizer_module, set_lora_state
from .schedule import WeightsEMA

TMP_PREFIX = ".tmp-"  # a checkpoint being written or pruned: never read, removed by the next save


def expert_file(name: str, experts: Sequence[str], k: int) -> str:
    """The file of expert k's LoRA (or EMA: `name` is LORA_FILE or EMA_FILE): `name` for the first expert,
    `<stem>_<expert>.safetensors` for another."""
    return name if k == 0 else name.replace(".safetensors", f"_{experts[k]}.safetensors")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    with open(tmp) as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _jsonable(o):
    return sorted(o) if isinstance(o, set) else str(o)


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read back (a missing or damaged file)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk, any write error): one line naming the folder, the bytes
    it needs and those free; the folder is as it was before the save."""


class _LoraWriter(Protocol):
    """A diffusers pipeline class as the LoRA writer (its LoRA loader mixin's `save_lora_weights`)."""

    @classmethod
    def save_lora_weights(cls, save_directory: str | os.PathLike, *, transformer_lora_layers: dict,
                          weight_name: str, transformer_lora_adapter_metadata: dict) -> None: ...


def rng_state() -> dict:
    """Every RNG's state, as tensors and plain values (numpy's key array as an int64 tensor)."""
    legacy = np.random.get_state(legacy=True)  # the default: a tuple for the global MT19937 state
    assert isinstance(legacy, tuple)  # (numpy's stub types the call without `legacy` as the dict form)
    name, keys, pos, has_gauss, cached = legacy
    return {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                   cached),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(family: ModelFamily, root: Path, step: int, lora_fp32: dict[str, torch.Tensor],
                    adapter_config: dict, optimizer_state: dict, trainer_state: dict, scheduler: dict | None = None,
                    ema: dict[str, torch.Tensor] | None = None, experts: Sequence[str] = ("transformer",),
                    keep: int = 0, extra_state: dict | None = None) -> Path:
    """Rank 0 only. The LoRA files are written by the family's diffusers pipeline class. `scheduler`: the lr
    scheduler's state dict; `ema`: the EMA of the LoRA (fp32); `experts`: the checkpoint's experts, in order (the
    LoRA's names are `spec.expert_prefix`ed: each trained expert gets its own files); `keep` > 0: prune all but the
    `keep` newest complete checkpoints (`prune`); `extra_state`: more entries of optimizer.pt (tensors and plain
    values). Returns the checkpoint folder. Any write error (a full disk) raises
    CheckpointWriteError with the folder as it was before the call: no temporary folder left, the previous
    checkpoints untouched."""
    ckpts = root / "checkpoints"
    final = ckpts / f"step-{step:06d}"
    tmp = ckpts / f"{TMP_PREFIX}step-{step:06d}"
    remove_leftovers(ckpts)  # a killed or failed save's temporary folder would hold its share of the disk
    extra = {"optimizer": optimizer_state, "rng": rng_state(), **(extra_state or {})}
    if scheduler is not None:
        extra["scheduler"] = scheduler
    renamed, failure = False, None
    try:
        ckpts.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        # diffusers' own writer: `transformer.`-prefixed PEFT names plus the adapter config as safetensors
        # metadata, which `load_lora_weights` reads for alpha and targets.
        config = json.loads(json.dumps(adapter_config, default=_jsonable))  # sets/enums -> lists/strings, as PEFT
        pipeline: type[_LoraWriter] = family.pipeline_type()
        for name, weights in ((LORA_FILE, lora_fp32), (EMA_FILE, ema)):
            if weights is None:
                continue
            for k, part in enumerate(split_by_expert(weights, experts)):
                if part:  # an expert the run does not train has no LoRA
                    layers = {n: v.contiguous().cpu() for n, v in part.items()}
                    pipeline.save_lora_weights(tmp, transformer_lora_layers=layers,
                                               weight_name=expert_file(name, experts, k),
                                               transformer_lora_adapter_metadata=config)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        torch.save(extra, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / COMPLETE).write_text("ok\n")
        publish(tmp)  # the LoRA files as readable as the rest (safetensors writes 0600)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        renamed = True
        _atomic_write_text(ckpts / "latest", final.name + "\n")
    except Exception as e:  # noqa: BLE001 - torch.save reports a full disk as "enforce fail ... unexpected pos"
        # As before the call: `latest` still names the previous checkpoint, so a renamed but unnamed one goes too.
        for leftover in (tmp, final) if renamed else (tmp,):
            shutil.rmtree(leftover, ignore_errors=True)
        failure = (" ".join(f"{type(e).__name__}: {e}".split()), getattr(e, "errno", None))
    except BaseException:  # Ctrl-C: no temporary folder left behind either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if failure is not None:  # out of the except block: the failed writer (held by the traceback) has closed its file
        remove_leftovers(ckpts)
        raise CheckpointWriteError(_write_failure(ckpts, final.name, *failure, payload_bytes(lora_fp32, ema, extra)))
    if keep:
        prune(root, keep)
    return final


def payload_bytes(*states) -> int:
    """The bytes of every tensor in `states` (nested dicts, lists, tuples): what a checkpoint of them writes, less
    a few kilobytes of headers and JSON."""
    total = 0
    for s in states:
        if isinstance(s, torch.Tensor):
            total += s.numel() * s.element_size()
        elif isinstance(s, dict):
            total += payload_bytes(*s.values())
        elif isinstance(s, (list, tuple)):
            total += payload_bytes(*s)
    return total


def _write_failure(ckpts: Path, name: str, error: str, code: int | None, needed: int) -> str:
    """One line: what failed (`error`, its errno `code`), the bytes the checkpoint needs and those free, the
    checkpoint that remains."""
    free = shutil.disk_usage(ckpts if ckpts.is_dir() else ckpts.parent).free
    # torch.save reports a full disk without its errno (a RuntimeError "... unexpected pos"), safetensors as text.
    full = code == errno.ENOSPC or "No space left" in error or free < needed
    before = latest_checkpoint(ckpts.parent)
    left = (f"the previous checkpoint {before} is intact: free space and --resume" if before is not None else
            "no earlier checkpoint exists: free space and start again with --resume auto")
    return (f"cannot write checkpoint {ckpts / name} ({'the disk is full' if full else error[:300]}): it needs about "
            f"{needed:,} bytes, {free:,} are free there; its temporary folder is removed and {left}")


def remove_leftovers(ckpts: Path) -> None:
    """Remove the temporary folders and files of saves and prunes that did not finish (a killed run's); only the
    run folder's lock holder writes here."""
    for leftover in ckpts.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    (ckpts / ".latest.tmp").unlink(missing_ok=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the `keep` newest complete checkpoints at or below the latest (the one `latest` names, never
    pruned); complete checkpoints past it (left by a run that resumed from an earlier one) are left for the run to
    overwrite. Returns the folders removed. Each goes by an atomic rename first, so a kill mid-removal leaves a
    temporary folder (removed by the next save), never a half-deleted checkpoint that still looks complete."""
    done = complete_checkpoints(root)
    if not done:
        return []
    latest = done[0]
    older = sorted((d for d in done[1:] if d.name < latest.name), reverse=True)
    removed = []
    for d in older[keep - 1:]:
        doomed = d.with_name(f"{TMP_PREFIX}pruned-{d.name}")
        try:
            os.replace(d, doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            warnings.warn(f"--keep-checkpoints {keep}: cannot remove {d} ({e.strerror}); it stays", stacklevel=2)
            continue
        removed.append(d)
    return removed


def resume_point(root: str | Path) -> str:
    """For the error line of a run that stopped: the checkpoint `--resume` continues from, or that there is none."""
    root = Path(root)
    latest = latest_checkpoint(root)
    if latest is None:
        return f"no checkpoint was written before it stopped (none in {root / 'checkpoints'}): start again with " \
               "--resume auto"
    return f"its last checkpoint is intact ({latest}): --resume continues from it"


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor] | None, dict, dict]:
    """(LoRA fp32 masters by PEFT name, optimizer+rng(+scheduler) state with the EMA of the LoRA under "ema" when
    saved, trainer state). A missing or damaged file raises CheckpointError. A full-parameter run's checkpoint
    (`full_checkpoint`) gives (None, its scheduler and RNG states, trainer state): its shards load into the built
    models."""
    missing = [f for f in ("optimizer.pt", "trainer_state.json", COMPLETE) if not (path / f).is_file()]
    try:
        state = json.loads((path / "trainer_state.json").read_text()) if "trainer_state.json" not in missing else {}
        if not isinstance(state, dict):
            raise ValueError("trainer_state.json holds no JSON object")
    except Exception as e:  # noqa: BLE001 - whatever the damage, the folder cannot be resumed from
        raise _unreadable(path, e) from None
    if state.get("full"):  # a full-parameter run's: DCP shards, loaded into the built models
        from . import full_checkpoint

        if COMPLETE in missing:
            raise CheckpointError(f"checkpoint {path} is incomplete (missing COMPLETE)")
        return None, full_checkpoint.read(path, state), state
    # Each trained expert's files (a one-expert checkpoint: LORA_FILE alone).
    experts: list[str] = state.get("experts", ["transformer"])
    trained = [k for k, e in enumerate(experts) if e in state.get("lora_experts", experts)]
    missing = [f for k in trained if not (path / (f := expert_file(LORA_FILE, experts, k))).is_file()] + missing
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete (missing {', '.join(missing)})")

    def read(name: str) -> dict[str, torch.Tensor]:
        return {f"{expert_prefix(experts, k)}{n.removeprefix(DIFFUSERS_PREFIX)}": v for k in trained
                for n, v in load_file(str(path / expert_file(name, experts, k))).items()}

    try:
        lora = read(LORA_FILE)
        extra = torch.load(path / "optimizer.pt", weights_only=True)
        if (path / expert_file(EMA_FILE, experts, trained[0])).is_file():
            extra["ema"] = read(EMA_FILE)
    except Exception as e:  # noqa: BLE001 - whatever the damage, the folder cannot be resumed from
        raise _unreadable(path, e) from None
    return lora, extra, state


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    reason = " ".join(str(e).split())[:200]
    return CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {reason})")


def load_latest(root: Path) -> tuple[Path, dict[str, torch.Tensor] | None, dict, dict] | None:
    """(path, *load_checkpoint(path)) of the newest complete checkpoint that reads back; a damaged one is skipped
    with a warning. None when there is no complete checkpoint; CheckpointError when none of them reads back."""
    failures = []
    for path in complete_checkpoints(root):
        try:
            loaded = (path, *load_checkpoint(path))
        except CheckpointError as e:
            failures.append(str(e))
            continue
        if failures:
            warnings.warn(f"{'; '.join(failures)}: resuming from {path.name} instead", stacklevel=2)
        return loaded
    if failures:
        raise CheckpointError(f"no checkpoint of {root} reads back ({'; '.join(failures)}); move {root} aside to "
                              "start over")
    return None


def save_training(family: ModelFamily, root: Path, ctx: DistContext, models: Mapping[str, torch.nn.Module],
                  optimizer: torch.optim.Optimizer, scheduler, ema: WeightsEMA | None, lora_spec: LoraSpec, step: int,
                  rollout: int, metrics_lines: int | None, config: dict, extra_state: dict | None = None) -> None:
    """A training checkpoint at `step`: the LoRA of `models` (expert name -> policy, in order), `optimizer`, the
    lr `scheduler`, the `ema`, the RNGs, the trainer state (`rollout`s done, `metrics_lines` written, the
    settings) and `extra_state` (unsharded; `load_checkpoint` gives it back in its extra). Every rank takes part
    (the full states are collectives); rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    lora = lora_full_state(models)
    ema_state = ema.full_state() if ema is not None else None
    optim = get_optimizer_state_dict(optimizer_module(models), optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    failure = None
    if ctx.is_main:
        experts = list(models)
        trainer_state: dict[str, Any] = {"step": step, "rollout": rollout, "metrics_lines": metrics_lines,
                                         "config": config}
        if len(experts) > 1:
            trained = [e for e, part in zip(experts, split_by_expert(lora, experts)) if part]
            trainer_state |= {"experts": experts, "lora_experts": trained}
        try:
            save_checkpoint(family, root, step, lora, lora_spec.peft_config().to_dict(), optim, trainer_state,
                            scheduler=scheduler.state_dict(), ema=ema_state, experts=experts,
                            keep=config.get("keep_checkpoints") or 0, extra_state=extra_state)
        except CheckpointWriteError as e:
            failure = str(e)
    if ctx.world > 1:  # also the barrier: no rank runs on past a checkpoint that rank 0 could not write
        failure = all_gather_object(failure)[0]
    if failure is not None:
        raise CheckpointWriteError(failure)


def restore_training(resumed: tuple[Path, dict[str, torch.Tensor], dict, dict],
                     models: Mapping[str, torch.nn.Module], named_params: dict[str, torch.nn.Parameter],
                     optimizer: torch.optim.Optimizer, scheduler, ema: WeightsEMA | None) -> dict:
    """Put what `load_latest` read back into the LoRA, the optimizer, the lr scheduler, the EMA and the RNGs;
    return the saved trainer state (step, rollout, metrics_lines, ...)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    path, lora, extra, state = resumed
    set_lora_state(named_params, lora)
    # strict=False: a LoRA parameter that never got a gradient (the last block's text-stream outputs feed
    # nothing) has no AdamW state to save, exactly as in the run that saved it.
    set_optimizer_state_dict(optimizer_module(models), optimizer, extra["optimizer"],
                             options=StateDictOptions(full_state_dict=True, strict=False))
    if "scheduler" in extra:  # a checkpoint from before schedules ran the constant lr
        scheduler.load_state_dict(extra["scheduler"])
    if ema is not None:
        if "ema" not in extra:
            raise ValueError(f"--resume: {path} holds no EMA of the LoRA; resume with the run's --ema-decay "
                             "(0), or start a new --output-dir")
        ema.load_full(extra["ema"])
    set_rng_state(extra["rng"])
    return state
