"""`trueflow train`: set up a run (process group, checkpoint, engine, reward) and hand it to the Trainer."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .config import TrainConfig
from .dist import init_distributed

DEFAULT_CHECKPOINT = Path("runs/tiny-checkpoint")


def _ensure_checkpoint(cfg: TrainConfig, is_main: bool) -> None:
    """No --checkpoint: make (once) and use the tiny one, so `trueflow train` runs with no arguments."""
    if cfg.checkpoint is not None:
        return
    cfg.checkpoint = str(DEFAULT_CHECKPOINT)
    if is_main and not (DEFAULT_CHECKPOINT / "model_index.json").is_file():
        from ..checkpoints.qwen_image import init_checkpoint

        init_checkpoint(DEFAULT_CHECKPOINT, seed=0, overwrite=True)
        print(f"made the tiny demo checkpoint {DEFAULT_CHECKPOINT}")


def run_training(cfg: TrainConfig) -> Path | None:
    """Runs on every rank; returns the run folder on rank 0, None elsewhere."""
    cfg.validate()
    if not cfg.resume and (Path(cfg.output_dir) / "metrics.jsonl").exists():  # before anything heavy starts
        raise FileExistsError(f"{cfg.output_dir} holds a run: use --resume to continue it, or another --output-dir")
    ctx = init_distributed(cfg.device)
    try:
        _ensure_checkpoint(cfg, ctx.is_main)
        if ctx.world > 1:
            dist.barrier()
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
        engine = reward = None
        if ctx.is_main:
            engine = _start_engine(cfg, dtype, ctx.device)
            if not (cfg.engine_process and cfg.reward_placement == "engine"):
                from ..rewards.base import build_reward

                reward = build_reward(cfg.reward, cfg.reward_model, str(ctx.device))
        from .trainer import Trainer

        Trainer(cfg, ctx, engine, reward).run()
        if ctx.is_main and hasattr(engine, "close"):
            engine.close()
        return Path(cfg.output_dir) if ctx.is_main else None
    finally:
        dist.destroy_process_group()


def _start_engine(cfg: TrainConfig, dtype: torch.dtype, device: torch.device):
    if cfg.engine_process:
        from ..sync.engine_process import EngineClient

        reward = (cfg.reward, cfg.reward_model, str(device)) if cfg.reward_placement == "engine" else None
        return EngineClient(cfg.checkpoint, cfg.rollout_patch_group, tuple(cfg.disable_patch), str(device), dtype,
                            threads=torch.get_num_threads(), reward=reward)
    from ..engine.engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        return Engine(cfg.checkpoint, cfg.rollout_patch_group, tuple(cfg.disable_patch), device, dtype)
