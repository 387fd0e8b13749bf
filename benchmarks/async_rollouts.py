"""`--async-rollouts 1` against synchronous training on the CPU: images per second of the steady state, one engine
process and one trainer, one thread each, in one run, interleaved.

    python benchmarks/async_rollouts.py --out async.json [--repeats 10] [--rollouts 4] [--steps 4]
        [--num-sde-steps 2] [--checkpoint DIR]

One engine process (`--engine-process`, the reward scored there too, so the trainer's process trains and only
waits on its rollout thread) serves every run; each repeat trains a fresh Trainer synchronously and one with
`--async-rollouts 1`, in alternating order, on the tiny Qwen-Image checkpoint (written once, seed 0, unless
--checkpoint names one). A run's steady state is the span from its first optimizer step's metrics line to its last:
(rollouts - 1) rollouts of images, with their syncs, no start-up. What async should approach, from the sync run's
own times (its rollout R, its train step T, each a median over its steps):

    speed-up ≤ (R + T) / max(R, T)

— the rollout hides behind the train step (or the other way round) when both get a core of their own; the sync of
the weights stays serial in both. On a machine whose cores other work also takes, the overlap gets less than that.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trueflow.checkpoints import init_checkpoint
from trueflow.placement import build_engine
from trueflow.train.config import TrainConfig
from trueflow.train.dist import init_distributed
from trueflow.train.metrics import MetricsWriter, read_metrics
from trueflow.train.run import engine_placement
from trueflow.train.trainer import Trainer


def _config(args, checkpoint: Path, out: Path, async_rollouts: int) -> TrainConfig:
    return TrainConfig(checkpoint=str(checkpoint), output_dir=str(out), num_rollouts=args.rollouts, steps=args.steps,
                       num_sde_steps=args.num_sde_steps, rollout_batch_size=1, n_samples_per_prompt=4,
                       rollout_microgroup_size=4, micro_batch_size_sample=4, sample_every=0, save_every=0,
                       engine_process=True, reward_placement="engine", threads=1, async_rollouts=async_rollouts)


def _timed_run(cfg: TrainConfig, ctx, engine) -> dict:
    """One run on the shared engine; its steady-state images/s and its median rollout / train / sync times."""
    stamps: list[float] = []
    write = MetricsWriter.write

    def stamped(self, record):
        write(self, record)
        stamps.append(time.perf_counter())

    MetricsWriter.write = stamped
    try:
        Trainer(cfg, ctx, engine).run()
    finally:
        MetricsWriter.write = write
    rows = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    images = cfg.rollout_batch_size * cfg.n_samples_per_prompt * (len(rows) - 1)
    assert all(r["model_output_max_abs_diff"] == 0.0 and r["log_prob_max_abs_diff"] == 0.0 for r in rows), rows
    med = {k: statistics.median(r[k] for r in rows) for k in ("time_rollout", "time_train", "time_sync")}
    return {"images_per_s": images / (stamps[-1] - stamps[0]), **med,
            "time_wait": statistics.median(r.get("time_wait", 0.0) for r in rows[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--num-sde-steps", type=int, default=2)
    p.add_argument("--checkpoint", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="trueflow-async-bench-"))
    checkpoint = args.checkpoint or init_checkpoint(tmp / "tiny", seed=0)
    ctx = init_distributed("cpu")
    engine = build_engine(*engine_placement(_config(args, checkpoint, tmp / "x", 0), ctx.device))
    result = {"command": " ".join(["python", "benchmarks/async_rollouts.py", *os.sys.argv[1:]]),
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "torch": torch.__version__, "settings": vars(args) | {
                  "checkpoint": str(checkpoint)}, "load_before": os.getloadavg(), "repeats": []}
    try:
        for i in range(args.repeats):
            order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
            row = {}
            for mode in order:
                row[mode] = _timed_run(_config(args, checkpoint, tmp / f"{mode}-{i}", int(mode == "async")), ctx,
                                       engine)
            s, a = row["sync"], row["async"]
            row["speedup"] = a["images_per_s"] / s["images_per_s"]
            row["bound"] = (s["time_rollout"] + s["time_train"]) / max(s["time_rollout"], s["time_train"])
            result["repeats"].append(row)
            print(f"repeat {i}: sync {s['images_per_s']:.3f} img/s, async {a['images_per_s']:.3f} img/s, "
                  f"x{row['speedup']:.3f} (bound x{row['bound']:.3f}; R {s['time_rollout']:.3f} s, "
                  f"T {s['time_train']:.3f} s)", flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        engine.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)  # the runs' folders and the tiny checkpoint
    result["load_after"] = os.getloadavg()
    rep = result["repeats"]
    summary = {}
    for key, get in (("sync_images_per_s", lambda r: r["sync"]["images_per_s"]),
                     ("async_images_per_s", lambda r: r["async"]["images_per_s"]),
                     ("speedup", lambda r: r["speedup"]), ("bound", lambda r: r["bound"]),
                     ("sync_time_rollout", lambda r: r["sync"]["time_rollout"]),
                     ("sync_time_train", lambda r: r["sync"]["time_train"]),
                     ("sync_time_sync", lambda r: r["sync"]["time_sync"]),
                     ("async_time_wait", lambda r: r["async"]["time_wait"])):
        values = [get(r) for r in rep]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    result["summary"] = summary
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| | median | min | max |\n|---|---|---|---|")
    for key, v in summary.items():
        print(f"| {key} | {v['median']:.3f} | {v['min']:.3f} | {v['max']:.3f} |")


if __name__ == "__main__":
    main()
