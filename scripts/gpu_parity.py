"""Parity on a CUDA device (issue B.6): the tiny checkpoint and the full-size architecture, train side on
diffusers' `_native_flash`, engine under the qwen_image patch group with the flash kernel pinned.

    python scripts/gpu_parity.py --out parity_gpu.json [--skip-full]

Prints one table per part and writes every result as JSON. Exit status 1 if a parity claim fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

import torch

from trueflow.checkpoints import init_checkpoint
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.parity.report import format_ablation


def _row(label: str, r, seconds: float) -> dict:
    print(f"  {label:58s} max {r.model_output_max_abs_diff:<10.3e} bitwise {str(r.bitwise_equal):5s} "
          f"first diff {r.first_differing_module or '-'}  ({seconds:.1f} s)")
    return {"case": label, **r.to_json(with_layers=False), "seconds": seconds}


def tiny(device: str) -> tuple[list[dict], bool]:
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as d:
        ck = init_checkpoint(f"{d}/tiny")
        print("tiny checkpoint on", device)
        for batch in (1, 4):
            for text_len in (7, 33):
                for res in (64, 128):
                    t0 = time.time()
                    probe = ParityProbe(ProbeSpec(checkpoint=str(ck), batch=batch, text_len=text_len,
                                                  resolution=res, device=device))
                    on, _ = probe.run("qwen_image")
                    off, _ = probe.run("none")
                    dt = time.time() - t0
                    rows.append(_row(f"b{batch} text {text_len} {res}px qwen_image", on, dt))
                    rows.append(_row(f"b{batch} text {text_len} {res}px none", off, dt))
                    ok &= on.bitwise_equal and not off.bitwise_equal
        t0 = time.time()
        probe = ParityProbe(ProbeSpec(checkpoint=str(ck), batch=4, lora_rank=8, device=device))
        engine = probe.build_engine("qwen_image")
        for step in range(4):
            if step:
                probe.step_lora(engine, seed=100 + step)
            r, _ = probe.compare_engine(engine, "qwen_image")
            rows.append(_row(f"b4 LoRA rank 8, after {step} LoRA update(s)", r, time.time() - t0))
            ok &= r.bitwise_equal
    return rows, ok


def full(device: str, ablate: bool) -> tuple[list[dict], list[dict], bool]:
    print("full-size architecture (60 layers, 24x128, joint 3584), random weights, 512px, microgroup 4, "
          "text 128, LoRA rank 64")
    t0 = time.time()
    probe = ParityProbe(ProbeSpec(random_size="full", batch=4, text_len=128, resolution=512, lora_rank=64,
                                  device=device, layer_report="blocks"))
    print(f"  train side built and run in {time.time() - t0:.1f} s")
    rows = []
    engine = probe.build_engine("qwen_image")
    for step in range(3):
        if step:
            probe.step_lora(engine, seed=200 + step)
        t1 = time.time()
        r, _ = probe.compare_engine(engine, "qwen_image")
        rows.append(_row(f"full b4 512px LoRA 64, after {step} LoRA update(s)", r, time.time() - t1))
    del engine
    ok = all(r["bitwise_equal"] for r in rows)
    ablation = []
    if ablate:
        results = probe.ablate("qwen_image")
        print(format_ablation(results))
        ablation = [r.to_json(with_layers=False) for r in results]
    return rows, ablation, ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--no-ablate", action="store_true")
    a = ap.parse_args()
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor(),
            "date": time.strftime("%Y-%m-%d")}
    print(info)
    tiny_rows, ok = tiny(a.device)
    report = {"info": info, "tiny": tiny_rows}
    json.dump(report, open(a.out, "w"), indent=1)
    if not a.skip_full:
        full_rows, ablation, ok_full = full(a.device, not a.no_ablate)
        report.update(full=full_rows, full_ablation=ablation)
        ok &= ok_full
    report["ok"] = ok
    json.dump(report, open(a.out, "w"), indent=1)
    print("ALL PARITY CLAIMS HOLD" if ok else "PARITY CLAIM FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
