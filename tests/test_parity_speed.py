"""`benchmarks/parity_speed.py --size tiny`: the CPU smoke run of the parity check-and-benchmark script. It checks
the flash pairing and the batch-invariant mode's rows bitwise (cuDNN has no CPU kernel: those rows are skipped),
times interleaved rounds, writes JSON, and exits 1 when a pairing is not bitwise (a patch switched off)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "parity_speed.py"


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "parity_speed.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--warmup", "1", "--repeats", "2",
                           "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_smoke_run_is_bitwise(tmp_path):
    proc, result = run(tmp_path, "--shapes", "32x1,32x2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every pairing bitwise: True" in proc.stdout
    rows = {(r["row"], r["shape"]): r for r in result["rows"]}
    for shape in ("32x1", "32x2"):
        for name in ("engine_parity_flash", "engine_parity_unfused"):
            r = rows[name, shape]
            assert r["bitwise"] is True and r["max_abs_diff"] == 0.0 and r["reference"] == "diffusers_flash"
            assert len(r["times_ms"]) == 2 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            assert r["speedup_vs_diffusers_flash"] > 0
        assert rows["engine_parity_unfused", shape]["triton_kernels"] is False
        assert rows["engine_parity_flash", shape]["patch_group"] == "qwen_image"
        assert rows["engine_parity_cudnn", shape]["patch_group"] == "qwen_image:_native_cudnn"
        for name in ("diffusers_cudnn", "engine_parity_cudnn"):
            assert rows[name, shape]["error"] == "skipped: needs CUDA"
        fast = rows["engine_fast", shape]  # fast mode: timed, not bitwise by design, its distance reported
        assert fast["bitwise"] is None and fast["patch_group"] == "none" and fast["max_abs_diff_vs_diffusers_flash"] > 0
        for name in ("engine_batch_invariant", "engine_batch_invariant_cfg"):  # the mode, against its diffusers row
            r = rows[name, shape]
            assert r["bitwise"] is True and r["reference"] == "diffusers_batch_invariant"
            assert r["patch_group"] == "qwen_image:trueflow_batch_invariant" and len(r["times_ms"]) == 2
        assert rows["diffusers_batch_invariant", shape]["speedup_vs_diffusers_flash"] > 0
    assert "batch-invariant mode at 32x2: engine_batch_invariant" in proc.stdout


def test_a_switched_off_patch_fails_the_check(tmp_path):
    proc, result = run(tmp_path, "--shapes", "32x1", "--disable-patch", "timestep_dtype")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every pairing bitwise: False" in proc.stdout
    checked = [r for r in result["rows"] if r.get("reference") and "error" not in r]
    assert checked and all(r["bitwise"] is False for r in checked)


def test_bad_arguments_are_one_line_errors(tmp_path):
    for args, needle in ((("--shapes", "33x1"), "multiple of 16"), (("--disable-patch", "nope"), "unknown patch")):
        proc, result = run(tmp_path, *args)
        assert proc.returncode == 2 and result is None
        assert needle in proc.stderr and "Traceback" not in proc.stderr
