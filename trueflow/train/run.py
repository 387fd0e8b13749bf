"""`trueflow train`: set up a run (process group, checkpoint, engine, reward) and hand it to the Trainer."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .config import TrainConfig, resume_changes
from .dist import init_distributed
from .lock import holding_run_lock, lock_run_folder
from .prompts import load_prompts

if TYPE_CHECKING:
    from ..engine.interface import RolloutEngine

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
    if cfg.resume is True and not out.exists():
        raise FileNotFoundError(f"--resume: no folder {out} to continue (--resume auto starts afresh there)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output-dir {out}: cannot create it ({e.strerror})") from None
    lock_run_folder(cfg, out)  # before anything in it is read: a live run there is refused
    if not cfg.resume and (out / "metrics.jsonl").exists():
        raise FileExistsError(f"{out} holds a run: use --resume to continue it, or another --output-dir")
    resumed = ckpt.load_latest(out) if cfg.resume else None
    if cfg.resume is True and resumed is None:
        raise FileNotFoundError(f"--resume: {out} holds no checkpoint to continue from (a run killed before its "
                                "first checkpoint leaves none); --resume auto starts afresh when there is none")
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
    tokens = math.prod(fam.pipeline.latent_grid(cfg.resolution, cfg.resolution, cfg.num_frames))
    try:
        fam.pipeline.schedule(config, cfg.steps, tokens)
    except ValueError as e:  # e.g. one step under a terminal stretch of the sigmas (shift_terminal) divides by zero
        raise ValueError(f"--steps {cfg.steps}: {e}; use more --steps") from None


@holding_run_lock
def run_training(cfg: TrainConfig) -> Path | None:
    """Runs on every rank; returns the run folder on rank 0, None elsewhere. Rank 0 holds the run folder's lock
    (`lock`) from its first look into the folder to the end."""
    resumed = _check_before_loading(cfg)
    if cfg.deterministic:
        use_deterministic_kernels()
    ctx = init_distributed(cfg.device)
    if cfg.threads is not None:  # every rank, so each rank's engine and train side run with the same count
        torch.set_num_threads(cfg.threads)
    engine = None
    try:
        _ensure_checkpoint(cfg, ctx.is_main)
        if ctx.world > 1:
            dist.barrier()
        engine = _start_engine(cfg, {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype], ctx.device)
        from .trainer import Trainer

        Trainer(cfg, ctx, engine, resumed).run()
        return Path(cfg.output_dir) if ctx.is_main else None
    finally:  # also when the run stops on an error: the engine process ends with it
        if engine is not None:
            engine.shutdown()
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


def _start_engine(cfg: TrainConfig, dtype: torch.dtype, device: torch.device) -> RolloutEngine:
    """This rank's engine, scored: in this process, in its own process (which may also hold the reward), a
    `trueflow serve` server (`--engine-url`, one per rank), or an engine actor of a Ray run (`--ray`)."""
    from ..engine.interface import ScoredEngine
    from ..rewards.base import build_reward
    from ..sync.engine_process import EngineClient

    where = dict(checkpoint=cfg.checkpoint, patch_group=cfg.engine_patch_group(),
                 disabled_patches=tuple(cfg.disable_patch), dtype=dtype, family=cfg.family)
    if cfg.tp > 1 and dist.get_world_size() > 1:
        raise ValueError(f"--tp {cfg.tp} takes one trainer rank (each rank's engine would claim the same devices); "
                         f"run --tp with a single process, or data-parallel ranks with --tp 1")
    process = dict(device=str(device), threads=torch.get_num_threads(), tp=cfg.tp,  # an engine of its own
                   tp_matched=cfg.train_tp_match == cfg.tp)
    if cfg.engine_process and cfg.reward_placement == "engine":  # scored in the engine process
        return EngineClient(**where, **process,
                            reward=(cfg.reward, cfg.reward_model, str(device), cfg.reward_url, cfg.reward_on_error,
                                    cfg.reward_frames))
    if cfg.ray and cfg.reward_placement == "actor":  # scored by this rank's reward actor
        from ..ray.actors import connect_engine

        return connect_engine(cfg, where, device, scored=True)
    reward = build_reward(cfg.reward, cfg.reward_model, str(device), url=cfg.reward_url)  # a bad spec fails fast
    if cfg.ray:
        from ..ray.actors import connect_engine

        engine = connect_engine(cfg, where, device)
    elif cfg.engine_process:
        engine = EngineClient(**where, **process)
    elif cfg.engine_url:
        from ..engine.http_engine import HttpEngine

        if len(cfg.engine_url) != dist.get_world_size():
            raise ValueError(f"--engine-url names {len(cfg.engine_url)} engine(s) for {dist.get_world_size()} ranks: "
                             f"give one per rank, in rank order")
        url = cfg.engine_url[dist.get_rank()]
        engine = HttpEngine(url)
        _check_served(cfg, engine.health(), url)
    else:
        from ..engine.engine import Engine

        with warnings.catch_warnings():
            warnings.simplefilter("default")
            engine = Engine(**where, device=device)
    return ScoredEngine(engine, reward, cfg.reward_on_error, cfg.reward_frames)


def _check_served(cfg: TrainConfig, health: dict, url: str) -> None:
    """A served engine must run what this run would have started itself: the same checkpoint, patch group, dtype
    and (on CPU, parity condition 9) thread count."""
    want = {"checkpoint": str(Path(cfg.checkpoint).resolve()), "patch_group": cfg.engine_patch_group(),
            "disabled_patches": list(cfg.disable_patch), "dtype": str(torch.bfloat16 if cfg.dtype == "bf16"
                                                                       else torch.float32).removeprefix("torch.")}
    got = {**{k: health.get(k) for k in want}, "checkpoint": str(Path(health.get("checkpoint", "")).resolve())}
    if str(health.get("device", "")).startswith("cpu"):
        want["threads"], got["threads"] = torch.get_num_threads(), health.get("threads")
    wrong = [f"{k} {got[k]!r} (this run: {want[k]!r})" for k in want if got[k] != want[k]]
    if wrong:
        raise ValueError(f"the engine server at {url} runs {', '.join(wrong)}; start it with this run's settings")
