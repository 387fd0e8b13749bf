"""Two runs of `trueflow train` on one GPU, with and without `--deterministic`, and a run killed between rollouts and
resumed: which metrics and saved LoRA tensors are equal bit for bit.

    python scripts/gpu_determinism.py --out DIR [--size tiny] [--rollouts 3] [--device cuda]

Prints a table and writes DIR/determinism.json. Exit status 1 if the deterministic runs or the resumed one differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from trueflow.train.checkpoint import LORA_FILE


DEVICE = "cuda"


def train(out: Path, checkpoint: Path, rollouts: int, *extra: str) -> float:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "trueflow", "train", "--checkpoint", str(checkpoint), "--output-dir", str(out),
           "--device", DEVICE, "--num-rollouts", str(rollouts), "--sample-every", "0", "--save-every", "1", *extra]
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


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
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    out = Path(a.out)
    ckpt = out / "checkpoint"
    subprocess.run([sys.executable, "-m", "trueflow", "init-checkpoint", "--size", a.size, "--out", str(ckpt),
                    "--overwrite"], check=True)
    secs = {}
    for name, extra in (("plain_1", ()), ("plain_2", ()), ("det_1", ("--deterministic",)),
                        ("det_2", ("--deterministic",))):
        secs[name] = train(out / name, ckpt, a.rollouts, *extra)
    # Killed after rollout rollouts-1 (a clean stop there is what a kill between rollouts leaves), then resumed.
    train(out / "det_resumed", ckpt, a.rollouts - 1, "--deterministic")
    secs["det_resumed"] = train(out / "det_resumed", ckpt, a.rollouts, "--deterministic", "--resume")
    result = {"secs": secs, "plain_runs_equal": same(out / "plain_1", out / "plain_2"),
              "deterministic_runs_equal": same(out / "det_1", out / "det_2"),
              "resumed_equals_uninterrupted": same(out / "det_1", out / "det_resumed"),
              "deterministic_equals_plain": same(out / "plain_1", out / "det_1")}
    (out / "determinism.json").write_text(json.dumps(result, indent=1))
    print(f"{'comparison':32s} {'metrics equal':>14s} {'LoRA equal':>11s}")
    for k, v in result.items():
        if k != "secs":
            print(f"{k:32s} {str(v[0]):>14s} {str(v[1]):>11s}")
    print("seconds per run:", {k: round(v, 1) for k, v in secs.items()})
    ok = all(result[k][0] and result[k][1] for k in ("deterministic_runs_equal", "resumed_equals_uninterrupted"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
