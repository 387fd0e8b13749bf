"""The seed's end-to-end check: train + rollout + colocated reward, debug snapshots on, 3 rollouts with LoRA
synced by IPC handles to an engine in its own process, under the recipe's aligned conditions — parity must be
exactly 0.0 at every optimizer step (and the ratio exactly 1, the weights really changing, checksums equal).

    python scripts/aligned_run.py --out runs/aligned                        # CPU processes, tiny checkpoint
    python scripts/aligned_run.py --out /tmp/aligned --device cuda --size full --reward pickscore
                                                                            # H200: full size, 512², LoRA 64
    python scripts/aligned_run.py --out /tmp/seed --device cuda --size full --reward pickscore --clip full --ray 4
                                        # the seed's run (scripts/seed_e2e.sh): Ray colocated, a reward actor per rank

Prints the per-step table and exits 1 if any step is not bitwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from trueflow.train.config import config_from_argv
from trueflow.train.metrics import read_metrics


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="tiny", choices=("tiny", "full"))
    ap.add_argument("--reward", default="redness", help="redness, or pickscore (a random CLIP is made)")
    ap.add_argument("--clip", default="tiny", choices=("tiny", "full"), help="pickscore's random CLIP: tiny, or of "
                    "ViT-H/14's size (PickScore's cost)")
    ap.add_argument("--ray", type=int, default=0, metavar="N", help="N trainer ranks and their engines as Ray actors "
                    "(colocated), the reward an actor beside each; 0: one process with the engine in its own")
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
        if torch.cuda.is_available():  # hand the drawn model's cached memory back: the run's processes need it
            torch.cuda.empty_cache()
    print(f"checkpoint ready in {time.time() - t0:.0f} s")
    flags = ["--config", "recipes/bitwise-aligned.yaml", "--checkpoint", str(ckpt), "--output-dir", str(out / "run"),
             "--device", a.device, "--reward", a.reward, "--debug"]
    if a.ray:  # the prompts split over the ranks: a share of whole prompt groups each
        flags += ["--ray", "--world-size", str(a.ray), "--reward-placement", "actor",
                  "--rollout-batch-size", str(2 * a.ray)]
    else:
        flags += ["--engine-process"]
    if a.reward.startswith("pickscore"):
        from trueflow.rewards.tiny_clip import init_clip_h, init_tiny_clip

        clip = out / f"clip-{a.clip}"
        if not (clip / "config.json").is_file():
            init_tiny_clip(clip) if a.clip == "tiny" else init_clip_h(clip, a.device)
        flags += ["--reward-model", str(clip)]
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
    # Throughput per device and where a step's time goes (the first step, with its captures, left out when there
    # are later ones): images of a rollout over the step's wall time (rollout + reward + train + sync).
    gpus = max(a.ray, 1)
    cfg = config_from_argv(flags)
    images = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    measured = rows[1:] or rows
    split = {k: sum(r[k] or 0.0 for r in measured) / len(measured)
             for k in ("time_rollout", "time_reward", "time_train", "time_sync")}
    step_s = sum(split.values())
    per_gpu = images / step_s / gpus
    print(f"{gpus} device(s), {images} images a rollout: {per_gpu:.3f} images/s per device; a step "
          + ", ".join(f"{k.removeprefix('time_')} {v:.2f} s" for k, v in split.items()))
    (out / "result.json").write_text(json.dumps({"ok": ok, "steps": rows, "size": a.size, "device": a.device,
                                                 "reward": a.reward, "clip": a.clip, "ray": a.ray,
                                                 "images_per_s_per_device": per_gpu, "time_split_s": split},
                                                indent=1))
    print("PARITY EXACTLY 0.0 AT EVERY STEP" if ok else "PARITY CLAIM FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
