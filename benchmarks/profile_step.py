"""Where one guided denoising step of the engine's fast mode spends its GPU time, by kernel class.

    python benchmarks/profile_step.py --out profile.json [--shape 1024x4]

The engine (patch group none: Triton kernels, cuDNN attention first) runs eagerly under torch.profiler (eager,
so every kernel is visible; the CUDA-graph row of rollout_vs_diffusers.py removes the launch gaps on top). Kernel
time is summed into GEMM, attention, Triton (the fused norm/modulation/RoPE/mul-add kernels) and other
(elementwise, copies, reductions), and compared with the step's wall time and with what the analytic FLOPs would
take at the GEMM ceiling measured in the same run. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from rollout_vs_diffusers import (cudnn_first, engine_step, gemm_ceiling_tflops, make_inputs, step_flops)
from trueflow.models.qwen_image.presets import build_transformer, transformer_config
from trueflow.engine.weights import build_engine_transformer

_CLASSES = (("attention", ("flash", "fmha", "cudnn", "sdpa")),
            ("GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
            ("elementwise", ("at::native", "elementwise", "reduce", "copy", "cat"), ))


def kernel_class(name: str) -> str:
    low = name.lower()
    # What is left after the library kernels are Triton's, named after their Python functions.
    return next((cls for cls, keys in _CLASSES if any(k in low for k in keys)), "Triton/other")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1024x4")
    ap.add_argument("--size", default="full")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res, batch = (int(v) for v in a.shape.split("x"))
    config = transformer_config(a.size)
    reference = build_transformer(config, seed=0, dtype=torch.bfloat16, device=device)
    engine = build_engine_transformer(config, reference.state_dict(), device, torch.bfloat16, "none")
    del reference
    inp = make_inputs(config, res, batch, device)
    step = engine_step(engine, inp)
    with torch.no_grad(), cudnn_first() if device == "cuda" else nullcontext():
        for _ in range(2):
            step()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
            sync()
    # Kernels only (on CUDA the operator rows repeat their kernels' time): device-side events.
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind]
    per_class: dict[str, float] = {}
    kernels = []
    for e in events:
        us = e.self_device_time_total if device == "cuda" else e.self_cpu_time_total
        if us <= 0:
            continue
        per_class[kernel_class(e.key)] = per_class.get(kernel_class(e.key), 0.0) + us / 1e3
        kernels.append((us / 1e3, e.count, kernel_class(e.key), e.key[:90]))
    kernels.sort(reverse=True)
    busy = sum(per_class.values())
    ceiling = gemm_ceiling_tflops() if device == "cuda" else float("nan")
    floor_ms = step_flops(config, res, batch) / (ceiling * 1e12) * 1e3
    print(f"engine fast mode, one guided step at {a.shape}, eager under the profiler; "
          f"wall {wall_ms:.1f} ms (unprofiled)")
    print(f"kernel time {busy:.1f} ms; at the measured GEMM ceiling ({ceiling:.0f} TFLOP/s) "
          f"the step's FLOPs take {floor_ms:.1f} ms")
    print(f"\n{'class':10s} {'ms':>9s} {'% of kernel time':>17s}")
    for cls, ms in sorted(per_class.items(), key=lambda kv: -kv[1]):
        print(f"{cls:10s} {ms:9.2f} {100 * ms / busy:16.1f}%")
    print(f"\n{'ms':>8s} {'calls':>6s} {'class':10s} kernel")
    for ms, n, cls, name in kernels[:15]:
        print(f"{ms:8.2f} {n:6d} {cls:10s} {name}")
    json.dump({"shape": a.shape, "wall_ms": wall_ms, "kernel_ms": busy, "per_class_ms": per_class,
               "gemm_ceiling_tflops": ceiling, "flops_floor_ms": floor_ms,
               "top_kernels": [{"ms": ms, "calls": n, "class": c, "name": name} for ms, n, c, name in kernels[:40]],
               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
