#!/usr/bin/env bash
# Issue 27's GPU rows of the batch-invariant mode (docs/patch-group.md), one part per call so each fits one 10-minute
# slot of one H200. Usage: bash scripts/gpu_batch_invariant.sh PART OUT_DIR, PART one of
#   kernels  the compiled Triton kernels at real widths with cuBLAS's failure side, and one block at 512², text 128,
#            LoRA 64, microgroup 8 against train micro-batches of 2 (the -m gpu tests of tests/test_batch_invariant.py)
#   qwen     full-size Qwen-Image: the engine's microgroup of 4 at 1024² against train micro-batches of 1, in the mode
#            (must be 0.0) and outside it (the plain group's failure side)
#   ltx      the same for LTX-2.3 at 512²
#   flux     the same for FLUX.1-dev at 1024²
#   speed    benchmarks/parity_speed.py's rows (the mode beside parity mode and diffusers) at 512x1 and 1024x4
set -euo pipefail
export PYTHONFAULTHANDLER=1
part=${1:?PART: kernels|qwen|ltx|flux|speed}; out=${2:-/tmp/batch_invariant}
mkdir -p "$out"
cell() {  # FAMILY RESOLUTION: the mode's cell, then its failure side; each line of JSON kept
  local common=(--random-size full --family "$1" --resolution "$2" --batch 4 --train-micro-batch 1 --text-len 128
                --lora-rank 64 --device cuda --layer-report blocks --json)
  python3 -m trueflow parity "${common[@]}" --batch-invariant | tee "$out/$1-mode.json"
  python3 -m trueflow parity "${common[@]}" | tee "$out/$1-stock.json"
  python3 - "$out/$1-mode.json" "$out/$1-stock.json" <<'PY'
import json, sys
mode, stock = (json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:])
print("mode", mode["model_output_max_abs_diff"], "stock", stock["model_output_max_abs_diff"])
ok = mode["bitwise_equal"] and not stock["bitwise_equal"]
print("BITWISE IN THE MODE, NOT OUTSIDE IT" if ok else "BATCH-INVARIANT CLAIM FAILED")
sys.exit(0 if ok else 1)
PY
}
case "$part" in
  kernels) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_batch_invariant.py -rA ;;
  qwen) cell qwen_image 1024 ;;
  ltx) cell ltx2 512 ;;
  flux) cell flux 1024 ;;
  speed) python3 benchmarks/parity_speed.py --out "$out/parity_speed.json" --shapes 512x1,1024x4 --repeats 5 ;;
  *) echo "unknown PART $part: kernels|qwen|ltx|flux|speed" >&2; exit 2 ;;
esac
