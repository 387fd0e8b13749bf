"""Two runs of `trueflow train` on one GPU, with and without `--deterministic`, and a run killed (SIGKILL, mid-run,
once the checkpoint of rollout `--rollouts`-1 is written) and resumed: which metrics and saved LoRA tensors are
equal bit for bit, and what each run cost.

    python scripts/gpu_determinism.py --out DIR [--size tiny|full] [--rollouts 3] [--device cuda]

`--size full`: the full-size Qwen-Image architecture (seeded random bf16 weights) at 512², 1 prompt x 4 samples,
LoRA 16 (a checkpoint of rank 64 with its AdamW state is ~5 GB; three per run beside the 40 GB model fill a 64 GB
disk), 10 steps, gradient checkpointing; a finished run keeps only its last checkpoint. `--size tiny`: the embedded
default. `--only-deterministic` skips the two plain runs (and the comparisons that need them).

Prints a table and writes DIR/determinism.json. Exit status 1 if the deterministic runs or the resumed one differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from trueflow.train.checkpoint import LORA_FILE


DEVICE = "cuda"
FULL = ["--resolution", "512", "--lora-rank", "16", "--steps", "10", "--noise-level", "1.2", "--gradient-checkpointing",
        "--rollout-batch-size", "1", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4",
        "--micro-batch-size-sample", "4"]
SIZE_FLAGS: list[str] = []


def command(out: Path, checkpoint: Path, rollouts: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trueflow", "train", "--checkpoint", str(checkpoint), "--output-dir", str(out),
            "--device", DEVICE, "--num-rollouts", str(rollouts), "--sample-every", "0", "--save-every", "1",
            *SIZE_FLAGS, *extra]


def train(out: Path, checkpoint: Path, rollouts: int, *extra: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(command(out, checkpoint, rollouts, *extra), check=True)
    took = time.perf_counter() - t0
    latest = (out / "checkpoints" / "latest").read_text().strip()
    for old in (out / "checkpoints").iterdir():  # only the last one is compared: room on the disk
        if old.is_dir() and old.name != latest:
            shutil.rmtree(old)
    return took


def killed(out: Path, checkpoint: Path, rollouts: int, *extra: str) -> str:
    """Start a run of `rollouts` and SIGKILL it as soon as the checkpoint of rollout `rollouts - 1` is written
    (its next rollout under way); returns what `latest` named when it was killed."""
    proc = subprocess.Popen(command(out, checkpoint, rollouts, *extra))
    latest = out / "checkpoints" / "latest"
    while proc.poll() is None:
        if latest.is_file() and json.loads((out / "checkpoints" / latest.read_text().strip() / "trainer_state.json")
                                           .read_text()).get("rollout", -1) >= rollouts - 1:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return latest.read_text().strip()
        time.sleep(0.05)
    raise RuntimeError(f"the run ended (exit {proc.returncode}) before it could be killed")


def numbers(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def lora(run: Path) -> dict:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run / "checkpoints" / latest / LORA_FILE))


def same(a: Path, b: Path) -> tuple[bool, bool]:
    la, lb = lora(a), lora(b)
    import torch

    return numbers(a) == numbers(b), la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="tiny", choices=("tiny", "full"))
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    ap.add_argument("--only-deterministic", action="store_true", help="skip the two plain runs")
    a = ap.parse_args()
    global DEVICE, SIZE_FLAGS
    DEVICE = a.device
    SIZE_FLAGS = FULL if a.size == "full" else []
    out = Path(a.out)
    ckpt = out / "checkpoint"
    t0 = time.perf_counter()
    if a.size == "full":  # drawn on the device in bf16 (40 GB), as scripts/aligned_run.py draws it
        import torch

        from trueflow.checkpoints import init_checkpoint

        init_checkpoint(ckpt, size="full", overwrite=True, dtype=torch.bfloat16, device=DEVICE)
        torch.cuda.empty_cache()
    else:
        subprocess.run([sys.executable, "-m", "trueflow", "init-checkpoint", "--size", a.size,
                        "--output-dir", str(ckpt), "--overwrite"], check=True)
    secs = {"checkpoint": time.perf_counter() - t0}
    runs = (("plain_1", ()), ("plain_2", ()))[:0 if a.only_deterministic else 2] + (("det_1", ("--deterministic",)),)
    for name, extra in runs:
        secs[name] = train(out / name, ckpt, a.rollouts, *extra)
        print(f"{name}: {secs[name]:.1f} s", flush=True)
    t0 = time.perf_counter()
    at = killed(out / "det_resumed", ckpt, a.rollouts, "--deterministic")
    secs["det_killed"] = time.perf_counter() - t0
    print(f"killed with `latest` at {at}; resuming", flush=True)
    secs["det_resumed"] = train(out / "det_resumed", ckpt, a.rollouts, "--deterministic", "--resume")
    result = {"secs": secs, "size": a.size, "rollouts": a.rollouts, "killed_at": at,
              "resumed_equals_uninterrupted": same(out / "det_1", out / "det_resumed")}
    if not a.only_deterministic:
        result.update(plain_runs_equal=same(out / "plain_1", out / "plain_2"),
                      deterministic_equals_plain=same(out / "plain_1", out / "det_1"))
    (out / "determinism.json").write_text(json.dumps(result, indent=1))
    print(f"{'comparison':32s} {'metrics equal':>14s} {'LoRA equal':>11s}")
    for k, v in result.items():
        if isinstance(v, tuple):
            print(f"{k:32s} {str(v[0]):>14s} {str(v[1]):>11s}")
    print("seconds per run:", {k: round(v, 1) for k, v in secs.items()})
    ok = all(result["resumed_equals_uninterrupted"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
