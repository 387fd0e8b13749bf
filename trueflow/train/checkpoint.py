"""Training checkpoints, written atomically, resumed exactly.

Layout of `OUTPUT_DIR/checkpoints/step-000012/`:
  pytorch_lora_weights.safetensors  the LoRA masters in fp32, PEFT names with diffusers' `transformer.` prefix —
                                    the family's pipeline (`QwenImagePipeline`) `.load_lora_weights(dir)` loads it
                                    (cast to the pipeline's dtype)
  pytorch_lora_weights_ema.safetensors  with --ema-decay: the EMA of the LoRA, same format
                                    (`load_lora_weights(dir, weight_name="pytorch_lora_weights_ema.safetensors")`)
  adapter_config.json               rank, alpha, target modules (PEFT's LoraConfig)
  optimizer.pt                      the optimizer's full (unsharded) state dict, the lr scheduler's, the RNG states
  trainer_state.json                step, rollout, metrics lines written, RNG states, settings
  COMPLETE                          written last; a folder without it is ignored on resume
A checkpoint is built in `.tmp-step-N` and renamed into place (os.replace is atomic on one file system), then
`latest` is rewritten the same way. A run killed at any moment leaves the previous checkpoint intact; a checkpoint
damaged later (e.g. a truncated file) is skipped on resume, with a warning, for the one before it.
`optimizer.pt` holds tensors and plain values only, and is read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from ..files import publish
from ..lora_files import (COMPLETE, DIFFUSERS_PREFIX, EMA_FILE, LORA_FILE, complete_checkpoints,  # noqa: F401 - re-exported
                          latest_checkpoint)
from ..models.spec import ModelFamily
from .dist import DistContext
from .model import LoraSpec
from .policy import lora_full_state, set_lora_state
from .schedule import LoraEMA



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


def rng_state() -> dict:
    """Every RNG's state, as tensors and plain values (numpy's key array as an int64 tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                   cached),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(family: ModelFamily, root: Path, step: int, lora_fp32: dict[str, torch.Tensor],
                    adapter_config: dict, optimizer_state: dict, trainer_state: dict, scheduler: dict | None = None,
                    ema: dict[str, torch.Tensor] | None = None) -> Path:
    """Rank 0 only. The LoRA files are written by the family's diffusers pipeline class. `scheduler`: the lr scheduler's state dict; `ema`: the EMA of the LoRA (fp32). Returns the
    checkpoint folder."""
    ckpts = root / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    final = ckpts / f"step-{step:06d}"
    tmp = ckpts / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # diffusers' own writer: `transformer.`-prefixed PEFT names plus the adapter config as safetensors metadata,
    # which `load_lora_weights` reads for alpha and targets.
    config = json.loads(json.dumps(adapter_config, default=_jsonable))  # sets/enums -> lists/strings, as PEFT
    pipeline = family.pipeline_type()
    for name, weights in ((LORA_FILE, lora_fp32), (EMA_FILE, ema)):
        if weights is not None:
            pipeline.save_lora_weights(tmp, transformer_lora_layers={k: v.contiguous().cpu() for k, v in weights.items()},
                                       weight_name=name, transformer_lora_adapter_metadata=config)
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    extra = {"optimizer": optimizer_state, "rng": rng_state()}
    if scheduler is not None:
        extra["scheduler"] = scheduler
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
    _atomic_write_text(ckpts / "latest", final.name + "\n")
    return final


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(LoRA fp32 masters by PEFT name, optimizer+rng(+scheduler) state with the EMA of the LoRA under "ema" when
    saved, trainer state). A missing or damaged file raises CheckpointError."""
    missing = [f for f in (LORA_FILE, "optimizer.pt", "trainer_state.json", COMPLETE) if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete (missing {', '.join(missing)})")
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        lora = {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in load_file(str(path / LORA_FILE)).items()}
        extra = torch.load(path / "optimizer.pt", weights_only=True)
        if (path / EMA_FILE).is_file():
            extra["ema"] = {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in load_file(str(path / EMA_FILE)).items()}
    except Exception as e:  # noqa: BLE001 - whatever the damage, the folder cannot be resumed from
        reason = " ".join(str(e).split())[:200]
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {reason})") from None
    return lora, extra, state


def load_latest(root: Path) -> tuple[Path, dict[str, torch.Tensor], dict, dict] | None:
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


def save_training(family: ModelFamily, root: Path, ctx: DistContext, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, scheduler, ema: LoraEMA | None, lora_spec: LoraSpec, step: int,
                  rollout: int, metrics_lines: int | None, config: dict) -> None:
    """A training checkpoint at `step`: `model`'s LoRA, `optimizer`, the lr `scheduler`, the `ema`, the RNGs and
    the trainer state (`rollout`s done, `metrics_lines` written, the settings). Every rank takes part (the full
    states are collectives); rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    lora = lora_full_state(model)
    ema_state = ema.full_state() if ema is not None else None
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        save_checkpoint(family, root, step, lora, lora_spec.peft_config().to_dict(), optim,
                        {"step": step, "rollout": rollout, "metrics_lines": metrics_lines, "config": config},
                        scheduler=scheduler.state_dict(), ema=ema_state)
    if ctx.world > 1:
        dist.barrier()


def restore_training(resumed: tuple[Path, dict[str, torch.Tensor], dict, dict], model: torch.nn.Module,
                     named_params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler,
                     ema: LoraEMA | None) -> dict:
    """Put what `load_latest` read back into the LoRA, the optimizer, the lr scheduler, the EMA and the RNGs;
    return the saved trainer state (step, rollout, metrics_lines, ...)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    path, lora, extra, state = resumed
    set_lora_state(named_params, lora)
    # strict=False: a LoRA parameter that never got a gradient (the last block's text-stream outputs feed
    # nothing) has no AdamW state to save, exactly as in the run that saved it.
    set_optimizer_state_dict(model, optimizer, extra["optimizer"],
                             options=StateDictOptions(full_state_dict=True, strict=False))
    if "scheduler" in extra:  # a checkpoint from before schedules ran the constant lr
        scheduler.load_state_dict(extra["scheduler"])
    if ema is not None:
        if "ema" not in extra:
            raise ValueError(f"--resume: {path} holds no EMA of the LoRA; resume with the run's --ema-decay "
                             "(0), or start a new --output-dir")
        set_lora_state(ema.shadow, extra["ema"])
    set_rng_state(extra["rng"])
    return state
