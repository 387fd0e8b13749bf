"""An aligned `trueflow train` run of the full-size LTX-2.3 transformer on one GPU (issue G2.6): the engine in its own
process, LoRA synced by CUDA IPC, the train side FSDP2 + PEFT on diffusers' model, `model_output_max_abs_diff`
recorded at every optimizer step.

    python scripts/gpu_ltx2_train.py write --out CKPT          # full-size transformer (bf16), tiny text stack
    python scripts/gpu_ltx2_train.py train --checkpoint CKPT --run RUN [--frames 33] [--resolution 512]

The checkpoint holds the real 2.3 transformer (48 layers, 4096/2048 wide) with seeded random weights, and a tiny
Gemma-3 with connectors as wide as the transformer's streams (a full Gemma-3 would not fit the disk beside it): the
DiT, which is what parity is about, is full size; the prompt embeddings come from a small random text stack.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def write(out: Path, size: str, device: str) -> None:
    from trueflow.models.ltx2.checkpoint import build_pipeline

    t0 = time.time()
    pipe = build_pipeline(size, seed=0, dtype=torch.bfloat16, device=device, text_size="tiny")
    print(f"built in {time.time() - t0:.1f} s; transformer "
          f"{sum(p.numel() for p in pipe.transformer.parameters()) / 1e9:.2f}B parameters", flush=True)
    pipe.to("cpu")
    pipe.save_pretrained(out, safe_serialization=True)
    print(f"written to {out} in {time.time() - t0:.1f} s", flush=True)


def train(checkpoint: Path, run: Path, frames: int, resolution: int, rollouts: int, steps: int, device: str) -> int:
    cmd = [sys.executable, "-m", "trueflow", "train", "--checkpoint", str(checkpoint), "--output-dir", str(run),
           "--device", device, "--engine-process", "--num-frames", str(frames), "--resolution", str(resolution),
           "--steps", str(steps), "--sampler", "cps", "--noise-level", "0.8", "--num-sde-steps", "2",
           "--cfg-scale", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "4",
           "--rollout-microgroup-size", "4", "--micro-batch-size-sample", "4", "--lora-rank", "64",
           "--lora-alpha", "128", "--lr", "2e-4", "--num-rollouts", str(rollouts), "--gradient-checkpointing",
           "--reward", "redness", "--sample-every", "0"]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd).returncode
    print(f"exit {rc} after {time.time() - t0:.1f} s", flush=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if rc == 0 else []
    keys = ("step", "model_output_max_abs_diff", "log_prob_max_abs_diff", "ratio_mean", "lora_update_norm",
            "checksums_equal", "time_rollout", "time_train", "time_sync")
    for r in rows:
        print({k: r[k] for k in keys}, flush=True)
    ok = rc == 0 and len(rows) == rollouts and all(r["model_output_max_abs_diff"] == 0.0 and r["checksums_equal"]
                                                  and r["lora_update_norm"] > 0 for r in rows)
    print("ALIGNED RUN BITWISE AT EVERY STEP" if ok else "ALIGNED RUN NOT BITWISE", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("write", "train"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--run", type=Path)
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", default="full", help="the transformer (tiny: a quick check of this script)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if a.what == "write":
        write(a.out, a.size, a.device)
        return 0
    return train(a.checkpoint, a.run, a.frames, a.resolution, a.rollouts, a.steps, a.device)


if __name__ == "__main__":
    raise SystemExit(main())
