"""LTX-2.3 parity and speed on a CUDA device (issue G2.6): the tiny checkpoint, then the full-size 2.3 architecture
(48 layers, 4096-wide video, 2048-wide audio) with seeded random weights, train side diffusers'
`LTX2VideoTransformer3DModel` on the `native` backend, engine under the `ltx` patch group.

    python scripts/gpu_ltx2.py --out ltx2_gpu.json [--skip-full] [--frames 9,33,57] [--reps 10]

Prints one table per part and writes every result as JSON. Exit status 1 if a parity claim fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

from trueflow.checkpoints import init_checkpoint
from trueflow.models import get_family
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.parity.report import format_ablation
from trueflow.train.model import train_forward

FAMILY = get_family("ltx2")


def _row(label: str, r, seconds: float) -> dict:
    print(f"  {label:58s} max {r.model_output_max_abs_diff:<10.3e} bitwise {str(r.bitwise_equal):5s} "
          f"first diff {r.first_differing_module or '-'}  ({seconds:.1f} s)")
    return {"case": label, **r.to_json(with_layers=False), "seconds": seconds}


def video_inputs(config: dict, batch: int, text_len: int, height: int, width: int, frames: int, seed: int,
                 device: str) -> dict:
    """Seeded inputs of a `height x width`, `frames`-frame video in the probe's layout (one timestep per sample)."""
    g = torch.Generator().manual_seed(seed)
    grid = FAMILY.pipeline.latent_grid(height, width, frames)
    tokens = grid[0] * grid[1] * grid[2]
    hs = torch.randn(batch, tokens, config["in_channels"], generator=g)
    text = torch.randn(batch, text_len, config["cross_attention_dim"], generator=g)
    audio_text = torch.randn(batch, text_len, config["audio_cross_attention_dim"], generator=g)
    t = (torch.rand(1, generator=g) * 1000).expand(batch).contiguous()
    return {"hidden_states": hs.to(device, torch.bfloat16), "timestep": t.to(device), "grid": grid,
            "cond": {"encoder_hidden_states": text.to(device, torch.bfloat16),
                     "audio_encoder_hidden_states": audio_text.to(device, torch.bfloat16)}}


def tiny(device: str) -> tuple[list[dict], bool]:
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as d:
        ck = init_checkpoint(f"{d}/tiny", family="ltx2")
        print("tiny ltx2 checkpoint on", device)
        for batch in (1, 4):
            for text_len in (7, 64):
                t0 = time.time()
                probe = ParityProbe(ProbeSpec(checkpoint=str(ck), batch=batch, text_len=text_len, resolution=64,
                                              device=device, lora_rank=8))
                on, _ = probe.run("ltx")
                off, _ = probe.run("none")
                dt = time.time() - t0
                rows.append(_row(f"b{batch} text {text_len} 64px 9 frames LoRA 8 ltx", on, dt))
                rows.append(_row(f"b{batch} text {text_len} 64px 9 frames LoRA 8 none", off, dt))
                ok &= on.bitwise_equal and not off.bitwise_equal
    return rows, ok


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def full(device: str, size: str, frames_list: list[int], height: int, width: int, reps: int,
         ablate: bool) -> tuple[dict, bool]:
    print(f"full-size LTX-2.3 (48 layers, 4096 video / 2048 audio), random weights, {width}x{height}, microgroup 4, "
          f"text 128, LoRA rank 64")
    t0 = time.time()
    probe = ParityProbe(ProbeSpec(random_size=size, family="ltx2", batch=4, text_len=128, resolution=64,
                                  lora_rank=64, device=device, layer_report="blocks"))
    print(f"  train side built in {time.time() - t0:.1f} s; "
          f"{_peak():.1f} GiB peak so far")
    rows, ok = [], True
    engine = probe.build_engine("ltx")
    fast = None
    for frames in frames_list:
        probe.set_inputs(video_inputs(probe.config, 4, 128, height, width, frames, 0, device))
        for step in range(3):
            if step:
                probe.step_lora(engine, seed=300 + 10 * frames + step)
            t1 = time.time()
            r, _ = probe.compare_engine(engine, "ltx")
            rows.append(_row(f"full b4 {width}x{height} {frames} frames LoRA 64, after {step} update(s)", r,
                             time.time() - t1))
            ok &= r.bitwise_equal
    print(f"  peak {_peak():.1f} GiB")
    # One denoising forward of a microgroup at the largest size: diffusers (the train side, eager) against the
    # engine in parity mode and in fast mode, interleaved, warm.
    speed = {}
    i = probe.inputs
    ts = FAMILY.train.timestep(i["timestep"], torch.bfloat16)
    fast = probe.build_engine("none")
    calls = {
        "diffusers": lambda: train_forward(FAMILY, probe.train, i["hidden_states"], ts, i["grid"], i["cond"],
                                           backend=probe.train_backend),
        "engine_parity": lambda: engine(hidden_states=i["hidden_states"], timestep=i["timestep"], grid=i["grid"],
                                        **i["cond"]),
        "engine_fast": lambda: fast(hidden_states=i["hidden_states"], timestep=i["timestep"], grid=i["grid"],
                                    **i["cond"]),
    }
    with torch.no_grad():
        for fn in calls.values():
            _time(fn, 2)  # warm-up
        samples = {k: [] for k in calls}
        for _ in range(reps):
            for k, fn in calls.items():
                samples[k] += _time(fn, 1)
    base = statistics.median(samples["diffusers"])
    print(f"  one forward, microgroup 4, {width}x{height} {frames_list[-1]} frames ({reps} interleaved reps):")
    for k, v in samples.items():
        med = statistics.median(v)
        speed[k] = {"median_s": med, "min_s": min(v), "max_s": max(v), "speedup_vs_diffusers": base / med}
        print(f"    {k:14s} median {med * 1e3:8.1f} ms  (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f})  "
              f"{base / med:.2f}x diffusers")
    fast = None  # frees the fast engine before the ablation (the lambdas read `fast` only when called above)
    ablation = []
    if ablate:
        probe.set_inputs(video_inputs(probe.config, 4, 128, height, width, frames_list[0], 0, device))
        del engine
        results = probe.ablate("ltx")
        print(format_ablation(results))
        ablation = [r.to_json(with_layers=False) for r in results]
    return {"rows": rows, "speed": speed, "ablation": ablation,
            "peak_gib": _peak()}, ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--no-ablate", action="store_true")
    ap.add_argument("--frames", default="9,33,57")
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--size", default="full", help="the random architecture (tiny: a quick check of this script)")
    a = ap.parse_args()
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor(),
            "date": time.strftime("%Y-%m-%d")}
    print(info)
    tiny_rows, ok = tiny(a.device)
    report = {"info": info, "tiny": tiny_rows}
    json.dump(report, open(a.out, "w"), indent=1)
    if not a.skip_full:
        part, ok_full = full(a.device, a.size, [int(f) for f in a.frames.split(",")], a.height, a.width, a.reps,
                             not a.no_ablate)
        report["full"] = part
        ok &= ok_full
    report["ok"] = ok
    json.dump(report, open(a.out, "w"), indent=1)
    print("ALL PARITY CLAIMS HOLD" if ok else "PARITY CLAIM FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
