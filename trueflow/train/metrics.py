"""Per-step metrics: one JSON line per optimizer step in metrics.jsonl (flushed as written), optional TensorBoard."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

TIMING_KEYS = ("time_rollout", "time_reward", "time_train", "time_sync")  # vary run to run


class MetricsWriter:
    def __init__(self, path: Path, tensorboard_dir: Path | None = None, keep_lines: int | None = None):
        """`keep_lines`: on resume, the lines up to the checkpoint are kept and any written after it (by the run
        that was killed) are dropped, so the resumed file equals an uninterrupted run's."""
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
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.lines += 1
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])
            self.tb.flush()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
