#!/usr/bin/env bash
# The seed's end-to-end check on N GPUs (issue M): a full-size Qwen-Image checkpoint with random bf16 weights,
# `trueflow train --ray --world-size N` colocated (a trainer rank, its engine and a PickScore reward actor on each
# GPU), the bitwise-aligned recipe at 512x512, microgroup 4, LoRA rank 64, PickScore on a random CLIP of ViT-H/14's
# size, 3 rollouts, debug on. Prints the per-step table, images/s per GPU and the time split; exits 1 unless every
# step has model_output_max_abs_diff 0.0, ratio exactly 1, lora_update_norm > 0 and every engine's checksum equal.
#   bash scripts/seed_e2e.sh N [OUT]
set -euo pipefail
n=${1:?usage: scripts/seed_e2e.sh N [OUT] (N GPUs)}
out=${2:-runs/seed-e2e-$n}
cd "$(dirname "$0")/.."
exec python scripts/aligned_run.py --out "$out" --device cuda --size full --reward pickscore --clip full --ray "$n"
