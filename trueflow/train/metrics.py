"""Per-step metrics: one JSON line per optimizer step in metrics.jsonl (flushed as written), optional TensorBoard
and Weights & Biases."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import datetime, UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Wall-clock values, which vary run to run (a comparison of two runs' records leaves them out): the phases' seconds
# and when the record was written (ISO 8601, UTC); time_wait: how long an --async-rollouts step waited for its rollout.
TIMING_KEYS = ("time_rollout", "time_reward", "time_train", "time_sync", "time_wait", "timestamp")


@dataclass(frozen=True)
class WandbSettings:
    """Where a run logs to Weights & Biases. The mode (online, offline) is W&B's own: WANDB_MODE=offline keeps
    everything on disk under `dir`/wandb for a later `wandb sync`."""

    project: str = "trueflow"
    name: str | None = None  # W&B picks one when None
    dir: Path | None = None  # the run folder, so the W&B files live beside metrics.jsonl
    config: dict | None = None  # the training config, shown with the run


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float (NaN, ±inf) replaced by None: JSON has no NaN, and a bare NaN in
    metrics.jsonl breaks every strict reader (jq, JavaScript, pandas with a strict parser)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a record (bools as 0/1): what TensorBoard and W&B chart."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def require_wandb() -> None:
    """Fail early, with the fix, when `--wandb` is asked for without the package. A ValueError: a setting this
    install cannot honour is a user error (the CLI prints one line, exit 2)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError("--wandb needs the wandb package: pip install 'trueflow[wandb]'") from None


def step_record(step: int, rollout: int, step_in_rollout: int, scored: torch.Tensor, dropped: int, train: dict,
                sync: dict, times: dict, time_train: float) -> dict:
    """One optimizer step's metrics line. `scored`: the rollout's rewards less the skipped (NaN) ones; `dropped`:
    the samples the reward skipped; `train`: the optimizer step's metrics; `sync`: the LoRA sync's checksums and
    time; `times`: the rollout's and reward's. Scripts read these names: keep them. `timestamp`: when the record was
    made, ISO 8601 in UTC."""
    return {"timestamp": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "step": step, "rollout": rollout, "step_in_rollout": step_in_rollout,
            "reward_mean": _mean(scored), "reward_std": _std(scored),
            "dropped_samples": dropped, **train,
            "checksums_equal": sync["checksums_equal"],
            "trainer_checksum": sync["trainer_checksum"], "engine_checksum": sync["engine_checksum"],
            **times, "time_train": time_train, "time_sync": sync["time_sync"]}


def _mean(x: torch.Tensor) -> float | None:
    return x.mean().item() if x.numel() else None


def _std(x: torch.Tensor) -> float | None:
    """The population std of the scored rewards; None when the reward skipped every sample (no warning)."""
    return x.std(unbiased=False).item() if x.numel() else None


class MetricsWriter:
    def __init__(self, path: Path, tensorboard_dir: Path | None = None, keep_lines: int | None = None,
                 wandb: WandbSettings | None = None):
        """`keep_lines`: on resume, the lines up to the checkpoint are kept and any written after it (by the run
        that was killed) are dropped, so the resumed file equals an uninterrupted run's. `wandb`: also log each
        record's numbers to a W&B run (a new W&B run per process, also on resume)."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        if keep_lines is not None:
            path.write_text("".join(lines[:keep_lines]))
        elif lines:
            raise FileExistsError(f"{path} exists: use --resume to continue that run, or another --output-dir")
        self.lines = keep_lines or 0
        self.tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # torch's writer needs the tensorboard package, which torch does not bring
                raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from None

            self.tb = SummaryWriter(str(tensorboard_dir))
        self.wandb_run = None
        if wandb is not None:
            require_wandb()
            import wandb as wandb_lib

            if wandb.dir is not None:
                Path(wandb.dir).mkdir(parents=True, exist_ok=True)
            try:
                self.wandb_run = wandb_lib.init(project=wandb.project, name=wandb.name,
                                                dir=str(wandb.dir) if wandb.dir is not None else None,
                                                config=strict_json(wandb.config))
            except wandb_lib.errors.UsageError as e:  # no API key and not offline: the user's to fix
                raise ValueError(f"--wandb: {e} (or set WANDB_MODE=offline to keep the run on disk)") from None

    def write(self, record: dict) -> None:
        # allow_nan=False: a non-finite value that strict_json missed raises here instead of corrupting the file.
        line = json.dumps(strict_json(record), allow_nan=False)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.lines += 1
        scalars = _scalars(record)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
            self.tb.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=record["step"])

    def close(self) -> None:
        """Finish the W&B run and close TensorBoard (metrics.jsonl is complete after every write)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
