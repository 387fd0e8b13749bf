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

from ..placement import EngineSpec, Placement, RewardSpec, build_engine
from ..placement.spec import RewardAt
from . import checkpoint as ckpt
from . import memory, shared_base
from .config import TrainConfig, resume_changes
from .dist import DistContext, init_distributed
from .lock import holding_run_lock, lock_run_folder

if TYPE_CHECKING:
    from .trainer import Trainer

DEFAULT_CHECKPOINT = Path("runs/tiny-checkpoint")


def _ensure_checkpoint(cfg: TrainConfig, is_main: bool) -> None:
    """The default checkpoint: made once (of `cfg.family`, else the default family), so `trueflow train` runs with
    no arguments."""
    assert cfg.checkpoint is not None  # `_check_before_loading` set the default
    if (is_main and Path(cfg.checkpoint) == DEFAULT_CHECKPOINT
            and not (DEFAULT_CHECKPOINT / "model_index.json").is_file()):
        from ..checkpoints import init_checkpoint

        init_checkpoint(DEFAULT_CHECKPOINT, family=cfg.family, seed=0, overwrite=True)
        print(f"made the tiny demo checkpoint {DEFAULT_CHECKPOINT}")


def _check_before_loading(cfg: TrainConfig) -> tuple | None:
    """Every check that needs no model, so a mistake costs no loading time. Returns the checkpoint to resume from
    (`checkpoint.load_latest`), if any."""
    cfg.validate()  # its preflight checks the prompts, the checkpoint folder and the run folder
    if cfg.checkpoint is None:
        cfg.checkpoint = str(DEFAULT_CHECKPOINT)
    _check_schedule(cfg)
    ranks = cfg.trainer_ranks()
    shared_base.decide(cfg, ranks)  # `--share-base-weights true` where the engine cannot read the base is refused
    # A setting that cannot fit its GPUs is refused here, from the checkpoint's headers alone.
    memory.check_fits(cfg, ranks)
    out = Path(cfg.output_dir)
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
    assert cfg.checkpoint is not None  # `_check_before_loading` set the default
    path = Path(cfg.checkpoint) / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text()) if path.is_file() else dict(fam.pipeline.scheduler_config)
    tokens = math.prod(fam.pipeline.latent_grid(*cfg.frame_size(), cfg.num_frames))
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
        trainer = start_trainer(cfg, ctx, resumed)
        engine = trainer.engine
        trainer.run()
        return Path(cfg.output_dir) if ctx.is_main else None
    finally:  # also when the run stops on an error: the engine process ends with it
        if engine is not None:
            engine.shutdown()
        dist.destroy_process_group()


def start_trainer(cfg: TrainConfig, ctx: DistContext, resumed: tuple | None = None) -> Trainer:
    """This rank's engine and the Trainer around it: an in-process engine on the policy's frozen base where
    `shared_base.decide` says so (built by the Trainer once the policy is loaded), else the placement's engine first.
    An engine of its own process that the Trainer fails to start around is shut down here."""
    from .trainer import Trainer

    spec, placement = engine_placement(cfg, ctx.device)
    if shared_base.decide(cfg, ctx.world):
        return Trainer(cfg, ctx, shared_base.EngineOnBase(spec, placement), resumed)
    if ctx.is_main and (line := shared_base.note(cfg, ctx.world)):
        print(line, flush=True)
    engine = build_engine(spec, placement)
    try:
        return Trainer(cfg, ctx, engine, resumed)
    except BaseException:
        engine.shutdown()
        raise


def use_deterministic_kernels() -> None:
    """Training whose every kernel is deterministic (`--deterministic`). The forward is already bitwise on rerun (the
    parity guarantee needs it); the backward is not by default on a GPU: split-K GEMMs may pick a workspace-dependent
    reduction order, atomics-based kernels add in arrival order. cuBLAS needs its workspace fixed before its first
    call, hence before any model is built."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def engine_placement(cfg: TrainConfig, device: torch.device) -> tuple[EngineSpec, Placement]:
    """This rank's engine as the placement factory takes it: what it runs (this run's checkpoint, patch group, dtype
    and CPU threads, parity condition 9) and where (in this process, in its own process(es) under `--tp`, a
    `trueflow serve` server per rank, or a Ray engine actor), scored by the run's reward where `--reward-placement`
    says."""
    assert cfg.checkpoint is not None  # `_check_before_loading` set the default
    spec = EngineSpec(cfg.checkpoint, cfg.engine_patch_group(), tuple(cfg.disable_patch), cfg.dtype, str(device),
                      cfg.family, threads=torch.get_num_threads())
    reward = RewardSpec(cfg.reward, cfg.reward_model, str(device), cfg.reward_url, cfg.reward_on_error,
                        cfg.reward_frames)
    places: dict[str, RewardAt] = {"trainer": "caller", "engine": "engine", "actor": "actor"}
    at = places[cfg.reward_placement]
    if cfg.tp > 1 and dist.get_world_size() > 1:
        raise ValueError(f"--tp {cfg.tp} takes one trainer rank (each rank's engine would claim the same devices); "
                         f"run --tp with a single process, or data-parallel ranks with --tp 1")
    if cfg.ray:
        trainers, engines = cfg.ray_ranks()
        kind = "ray_disaggregated" if engines else "ray_colocated"
        return spec, Placement(kind, ray_trainers=trainers, ray_engines=engines, reward=reward, reward_at=at)
    if cfg.engine_process:
        return spec, Placement("process", tp=cfg.tp, tp_matched=cfg.train_tp_match == cfg.tp, reward=reward,
                               reward_at=at)
    if cfg.engine_url:
        if len(cfg.engine_url) != dist.get_world_size():
            raise ValueError(f"--engine-url names {len(cfg.engine_url)} engine(s) for {dist.get_world_size()} ranks: "
                             f"give one per rank, in rank order")
        return spec, Placement("http", url=cfg.engine_url[dist.get_rank()], reward=reward)
    return spec, Placement("local", reward=reward)
