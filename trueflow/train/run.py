"""`trueflow train`: set up a run (process group, checkpoint, engine, reward) and hand it to the Trainer."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .config import TrainConfig, resume_changes
from .dist import init_distributed
from .prompts import load_prompts

DEFAULT_CHECKPOINT = Path("runs/tiny-checkpoint")


def _ensure_checkpoint(cfg: TrainConfig, is_main: bool) -> None:
    """The default checkpoint: made once (of `cfg.family`, else the default family), so `trueflow train` runs with
    no arguments."""
    if is_main and Path(cfg.checkpoint) == DEFAULT_CHECKPOINT and not (DEFAULT_CHECKPOINT / "model_index.json").is_file():
        from ..checkpoints import init_checkpoint

        init_checkpoint(DEFAULT_CHECKPOINT, family=cfg.family, seed=0, overwrite=True)
        print(f"made the tiny demo checkpoint {DEFAULT_CHECKPOINT}")


def _check_before_loading(cfg: TrainConfig) -> tuple | None:
    """Every check that needs no model, so a mistake costs no loading time. Returns the checkpoint to resume from
    (`checkpoint.load_latest`), if any."""
    cfg.validate()
    load_prompts(cfg.prompts)
    if cfg.checkpoint is None:
        cfg.checkpoint = str(DEFAULT_CHECKPOINT)
    elif not (Path(cfg.checkpoint) / "model_index.json").is_file():
        raise FileNotFoundError(f"--checkpoint {cfg.checkpoint}: not a diffusers pipeline folder (no model_index.json); "
                                "leave it unset for the tiny demo checkpoint")
    _check_schedule(cfg)
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output-dir {out} is a file: name a folder")
    if not cfg.resume and (out / "metrics.jsonl").exists():
        raise FileExistsError(f"{out} holds a run: use --resume to continue it, or another --output-dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output-dir {out}: cannot create it ({e.strerror})") from None
    resumed = ckpt.load_latest(out) if cfg.resume else None
    if resumed is not None:
        path, _, _, state = resumed
        refused, warned = resume_changes(state.get("config", {}), cfg)
        if refused:
            raise ValueError(f"--resume: {'; '.join(refused)} would change the run's math; resume with the run's "
                             f"settings (recorded in {path / 'trainer_state.json'}), or start a new --output-dir")
        for line in warned:
            warnings.warn(f"--resume with {line}: the numerics may differ in the last bits", stacklevel=2)
    return resumed


def _check_schedule(cfg: TrainConfig) -> None:
    """The engine's schedule for these steps, computed now from the checkpoint's scheduler config (no model); a
    checkpoint not made yet (the default one) has its family's tiny checkpoint's."""
    fam = cfg.model_family()
    path = Path(cfg.checkpoint) / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text()) if path.is_file() else dict(fam.pipeline.scheduler_config)
    rows, cols = fam.pipeline.latent_grid(cfg.resolution, cfg.resolution)[-2:]
    try:
        with np.errstate(invalid="ignore", divide="ignore"):  # the failure is reported below, once
            fam.pipeline.schedule(config, cfg.steps, rows * cols)
    except ValueError as e:  # e.g. one step under a terminal stretch of the sigmas (shift_terminal) divides by zero
        note = f" ({fam.pipeline.schedule_note})" if fam.pipeline.schedule_note else ""
        raise ValueError(f"--steps {cfg.steps}: {e}{note}; use more --steps") from None


def run_training(cfg: TrainConfig) -> Path | None:
    """Runs on every rank; returns the run folder on rank 0, None elsewhere."""
    resumed = _check_before_loading(cfg)
    if cfg.deterministic:
        use_deterministic_kernels()
    ctx = init_distributed(cfg.device)
    engine = reward = None
    try:
        _ensure_checkpoint(cfg, ctx.is_main)
        if ctx.world > 1:
            dist.barrier()
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
        if ctx.is_main:
            if not (cfg.engine_process and cfg.reward_placement == "engine"):  # before the engine: a bad spec fails fast
                from ..rewards.base import build_reward

                reward = build_reward(cfg.reward, cfg.reward_model, str(ctx.device), url=cfg.reward_url)
            engine = _start_engine(cfg, dtype, ctx.device)
        from .trainer import Trainer

        Trainer(cfg, ctx, engine, reward, resumed).run()
        return Path(cfg.output_dir) if ctx.is_main else None
    finally:  # also when the run stops on an error: the engine process ends with it
        if hasattr(engine, "close"):
            engine.close()
        dist.destroy_process_group()


def use_deterministic_kernels() -> None:
    """Training whose every kernel is deterministic (`--deterministic`). The forward is already bitwise on rerun (the
    parity guarantee needs it); the backward is not by default on a GPU: split-K GEMMs may pick a workspace-dependent
    reduction order, atomics-based kernels add in arrival order. cuBLAS needs its workspace fixed before its first
    call, hence before any model is built."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def _start_engine(cfg: TrainConfig, dtype: torch.dtype, device: torch.device):
    if cfg.engine_process:
        from ..sync.engine_process import EngineClient

        reward = ((cfg.reward, cfg.reward_model, str(device), cfg.reward_url) if cfg.reward_placement == "engine"
                  else None)
        return EngineClient(cfg.checkpoint, cfg.engine_patch_group(), tuple(cfg.disable_patch), str(device), dtype,
                            threads=torch.get_num_threads(), reward=reward, family=cfg.family)
    from ..engine.engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        return Engine(cfg.checkpoint, cfg.engine_patch_group(), tuple(cfg.disable_patch), device, dtype,
                      family=cfg.family)
