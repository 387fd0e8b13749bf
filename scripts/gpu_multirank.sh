#!/usr/bin/env bash
# FSDP2 over N GPUs with NCCL (torchrun), on the tiny checkpoint: the engine in rank 0's process, then in its own
# process; every step must be bitwise. Usage (on a machine with N GPUs): bash scripts/gpu_multirank.sh N OUT_DIR
set -euo pipefail
export PYTHONFAULTHANDLER=1  # a crash prints its Python frames
n=${1:-2}; out=${2:-/tmp/multirank}
mkdir -p "$out"
python3 -m trueflow init-checkpoint --output-dir "$out/ck" --overwrite
for placement in "" "--engine-process"; do
  run="$out/run${placement:+-engine-process}"
  rm -rf "$run"
  MASTER_ADDR=127.0.0.1 torchrun --nproc-per-node "$n" --master-addr 127.0.0.1 --master-port 29555 -m trueflow train \
    --checkpoint "$out/ck" --output-dir "$run" --device cuda --num-rollouts 3 --rollout-batch-size "$n" $placement
  python3 - "$run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(r["step"], r["model_output_max_abs_diff"], r["log_prob_max_abs_diff"], r["ratio_mean"], r["lora_update_norm"],
          r["checksums_equal"], round(r["reward_mean"], 5))
ok = len(rows) == 3 and all(r["model_output_max_abs_diff"] == 0.0 and r["ratio_mean"] == 1.0 and r["checksums_equal"]
                            and r["lora_update_norm"] > 0 for r in rows)
print("BITWISE AT EVERY STEP" if ok else "PARITY CLAIM FAILED")
sys.exit(0 if ok else 1)
PY
done
