"""The seed's end-to-end check: train + rollout + colocated reward, debug snapshots on, 3 rollouts with LoRA
synced by IPC handles to an engine in its own process, under the recipe's aligned conditions — parity must be
exactly 0.0 at every optimizer step (and the ratio exactly 1, the weights really changing, checksums equal).

    python scripts/aligned_run.py --out runs/aligned                        # CPU processes, tiny checkpoint
    python scripts/aligned_run.py --out /tmp/aligned --device cuda --size full --reward pickscore
                                                                            # H200: full size, 512², LoRA 64

Prints the per-step table and exits 1 if any step is not bitwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from trueflow.train.metrics import read_metrics


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="tiny", choices=("tiny", "full"))
    ap.add_argument("--reward", default="redness", help="redness, or pickscore (a tiny random CLIP is made)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ckpt = out / f"checkpoint-{a.size}"
    if not (ckpt / "model_index.json").is_file():
        import torch

        from trueflow.checkpoints import init_checkpoint

        # The full size is drawn on the device in bf16 (40 GB); the tiny one on the CPU in fp32.
        init_checkpoint(ckpt, size=a.size, overwrite=True, dtype=torch.bfloat16 if a.size == "full" else torch.float32,
                        device=a.device if a.size == "full" else "cpu")
    print(f"checkpoint ready in {time.time() - t0:.0f} s")
    flags = ["--config", "recipes/bitwise-aligned.yaml", "--checkpoint", str(ckpt), "--output-dir", str(out / "run"),
             "--engine-process", "--device", a.device, "--reward", a.reward]
    if a.reward.startswith("pickscore"):
        from trueflow.rewards.tiny_clip import init_tiny_clip

        flags += ["--reward-model", str(init_tiny_clip(out / "tiny-clip"))]
    if a.size == "full":  # the H200 setting: 512², microgroup 4, LoRA 64, the Qwen-Image recipe's sampler
        flags += ["--resolution", "512", "--lora-rank", "64", "--steps", "10", "--noise-level", "1.2",
                  "--gradient-checkpointing"]
    cmd = [sys.executable, "-m", "trueflow", "train", *flags]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    rows = read_metrics(out / "run" / "metrics.jsonl")
    ok = len(rows) == 3
    print(f"\n{'step':>4} {'model_output_max_abs_diff':>26} {'log_prob_max_abs_diff':>22} {'ratio_mean':>12} "
          f"{'lora_update_norm':>17} {'checksums_equal':>16} {'reward_mean':>12}")
    for r in rows:
        good = (r["model_output_max_abs_diff"] == 0.0 and r["log_prob_max_abs_diff"] == 0.0 and r["ratio_mean"] == 1.0
                and r["lora_update_norm"] > 0 and r["checksums_equal"])
        ok &= good
        print(f"{r['step']:>4} {r['model_output_max_abs_diff']:>26} {r['log_prob_max_abs_diff']:>22} "
              f"{r['ratio_mean']:>12} {r['lora_update_norm']:>17.4g} {str(r['checksums_equal']):>16} "
              f"{r['reward_mean']:>12.5g}")
    snapshots = sorted((out / "run" / "snapshots").glob("*.safetensors"))
    print(f"\n{len(snapshots)} rollout snapshots; total {time.time() - t0:.0f} s")
    (out / "result.json").write_text(json.dumps({"ok": ok, "steps": rows, "size": a.size, "device": a.device,
                                                 "reward": a.reward}, indent=1))
    print("PARITY EXACTLY 0.0 AT EVERY STEP" if ok else "PARITY CLAIM FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
