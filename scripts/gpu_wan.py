"""Wan2.2 parity and speed on a CUDA device (issue P1, part 5): the tiny checkpoints of both layouts, then the full-size
Wan2.2-T2V-A14B architecture, each of its two experts (`transformer` seed 0 at a high-noise timestep, `transformer_2`
seed 1 below the 0.875 boundary, each at its own CFG scale) built in turn with seeded random weights, train side
diffusers' `WanTransformer3DModel` (as `from_pretrained(torch_dtype=bf16)` holds it) on `_native_flash`, engine under
the `wan` patch group, CFG as `WanPipeline` runs it (positive then negative forward, `uncond + g·(cond − uncond)`).

    python scripts/gpu_wan.py --parts tiny,parity --experts transformer --out $OUT/wan_high.json
                                                           # on one H200: ~6 min, ~100 GiB peak
    python scripts/gpu_wan.py --parts parity --experts transformer_2 --out $OUT/wan_low.json     # the same
    python scripts/gpu_wan.py --parts speed --compile --out $OUT/wan_speed.json   # ~6 min, ~95 GiB peak
    python scripts/gpu_wan.py --size tiny --device cpu --height 32 --width 32 --frames 5 --speed-frames 5 \
        --text-len 16 --reps 1 --out w.json                # the smoke path (tests/test_wan_gpu_script.py)

At 480x832, microgroup 4, text 512 (the pipeline's zero-padded window), LoRA rank 64. parity: 0.0 after 0, 1 and 2
LoRA updates with the group on, per expert and frame count (33 and 81), and not bitwise with it off (81 frames, after
the same updates). speed: one guided step (two branch forwards and the CFG combine) at `--speed-frames` of diffusers
eager, the engine in parity mode and the engine's fast mode, interleaved, median of `--reps` after a warm-up; with
`--compile` a second phase with diffusers under regional `torch.compile` (`compile_repeated_blocks(fullgraph=True)`,
which compiles the blocks in place) interleaved with the two engines again. One expert is 14.3B parameters (28.6 GB
bf16): the parity part holds the train side and one engine (57 GB of weights; the 81-frame activations of a
microgroup add ~15 GB), the speed part the train side and both engines (86 GB). Both experts are checked in turn,
never both in memory. An estimate of the time, from FLOPs at ~60 % of the H200's bf16 peak: one 81-frame forward of
the microgroup ~15 s, a 33-frame one ~4 s. Prints a table per part and writes every result as JSON to `--out` (after
each frame count and part, so a run cut short keeps what it measured). Exit status 1 if a parity claim fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trueflow.checkpoints import init_checkpoint
from trueflow.engine.guidance import guide
from trueflow.models import get_family
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.train.model import train_forward

FAMILY = get_family("wan")
# The A14B's experts as the pipeline runs them: (component, random-weight seed, a timestep it serves, CFG scale) --
# recipes/wan22_a14b.yaml's guidance_scale 4.0 / guidance_scale_2 3.0; the boundary is 0.875 · 1000.
EXPERTS = {"transformer": (0, 937.5, 4.0), "transformer_2": (1, 437.5, 3.0)}


def _row(label: str, r, seconds: float) -> dict:
    print(f"  {label:64s} max {r.model_output_max_abs_diff:<10.3e} bitwise {str(r.bitwise_equal):5s} "
          f"({seconds:.1f} s)")
    return {"case": label, **r.to_json(with_layers=False), "seconds": seconds}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def _free() -> None:
    """Give a built model's device memory back before the next is built (on the CPU nothing waits for it: a full
    collection of a test process's heap costs seconds)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def video_inputs(config: dict, batch: int, text_len: int, height: int, width: int, frames: int, t: float,
                 seed: int, device: str) -> dict:
    """Seeded inputs of one denoising step of a `height x width`, `frames`-frame A14B video in the probe's layout: the
    packed latents, a prompt of `text_len` tokens (its valid ones followed by the pipeline's zeros), the schedule
    timestep `t` for the microgroup."""
    g = torch.Generator().manual_seed(seed)
    grid = FAMILY.pipeline.latent_grid(height, width, frames)
    tokens = grid[0] * grid[1] * grid[2]
    hs = torch.randn(batch, tokens, config["in_channels"] * 4, generator=g)
    text = torch.randn(batch, text_len, config["text_dim"], generator=g)
    text[:, text_len // 4:] = 0  # a prompt a quarter of the window long, zero-padded as _get_t5_prompt_embeds pads
    return {"hidden_states": hs.to(device, torch.bfloat16), "timestep": torch.full((batch,), t, device=device),
            "grid": grid, "cond": {"encoder_hidden_states": text.to(device, torch.bfloat16)}}


def tiny(device: str) -> tuple[list[dict], bool]:
    """Both layouts' tiny checkpoints: each A14B expert (the second with CFG), the TI2V-5B's image-to-video step;
    batch 1 and 4, LoRA 8, group on and off."""
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as d:
        for size, resolution, experts in (("tiny", 64, ("transformer", "transformer_2")), ("tiny_ti2v", 128, (None,))):
            ck = init_checkpoint(f"{d}/{size}", family="wan", size=size)
            print(f"{size} wan checkpoint on {device}")
            for expert in experts:
                for batch in (1, 4):
                    t0 = time.time()
                    probe = ParityProbe(ProbeSpec(checkpoint=str(ck), expert=expert, batch=batch, text_len=64,
                                                  resolution=resolution, device=device, lora_rank=8,
                                                  cfg_scale=3.0 if expert == "transformer_2" else 1.0))
                    on, off = probe.run("wan")[0], probe.run("none")[0]
                    label = f"{size} {expert or 'i2v'} b{batch} {resolution}px 9 frames LoRA 8"
                    rows += [_row(f"{label} wan", on, time.time() - t0), _row(f"{label} none", off, 0.0)]
                    ok &= on.bitwise_equal and not off.bitwise_equal
    return rows, ok


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def full_probe(expert: str, device: str, size: str, text_len: int) -> ParityProbe:
    """The train side of one A14B expert at full size (seeded random weights, LoRA 64), CFG at the expert's scale."""
    seed, t, scale = EXPERTS[expert]
    t0 = time.time()
    probe = ParityProbe(ProbeSpec(random_size=size, family="wan", batch=4, text_len=text_len, resolution=32,
                                  lora_rank=64, device=device, layer_report="none", seed=seed, cfg_scale=scale))
    print(f"  {expert}: train side built in {time.time() - t0:.1f} s; {_peak():.1f} GiB peak so far")
    return probe


def full_parity(expert: str, device: str, size: str, frames_list: list[int], height: int, width: int,
                text_len: int, save) -> tuple[list[dict], bool, ParityProbe]:
    """0.0 after 0, 1 and 2 LoRA updates under `wan` at each frame count, then the fast engine (`none`) at the last
    one after the same updates: not bitwise. `save(rows)` after each frame count (a run cut short keeps them).
    Returns the probe too (its train side, for the speed part of the same expert)."""
    seed, t, scale = EXPERTS[expert]
    print(f"full-size Wan2.2-A14B {expert} parity (seed {seed}, t {t}, CFG {scale}), random weights, {width}x{height}, "
          f"microgroup 4, text {text_len}, LoRA rank 64")
    probe = full_probe(expert, device, size, text_len)
    rows, ok = [], True
    engine = probe.build_engine("wan")
    for frames in frames_list:
        probe.set_inputs(video_inputs(probe.config, 4, text_len, height, width, frames, t, seed, device))
        for step in range(3):
            if step:
                probe.step_lora(engine, seed=300 + 10 * frames + step)
            t1 = time.time()
            r, _ = probe.compare_engine(engine, "wan")
            rows.append(_row(f"{expert} b4 {width}x{height} {frames} frames LoRA 64 CFG {scale}, after {step} "
                             f"update(s)", r, time.time() - t1))
            ok &= r.bitwise_equal
        save(rows)
    del engine
    _free()
    fast = probe.build_engine("none")  # the LoRA as the probe holds it now: after the last frame count's 2 updates
    t1 = time.time()
    r, _ = probe.compare_engine(fast, "none")
    rows.append(_row(f"{expert} b4 {width}x{height} {frames_list[-1]} frames, --patch-group none", r, time.time() - t1))
    ok &= not r.bitwise_equal
    print(f"  peak {_peak():.1f} GiB")
    return rows, ok, probe


def full_speed(expert: str, device: str, size: str, frames: int, height: int, width: int, text_len: int, reps: int,
               compile_baseline: bool, probe: ParityProbe | None = None) -> dict:
    """One guided step of a microgroup (two branch forwards and the CFG combine): diffusers (the train side) eager,
    optionally regionally compiled, against the engine in parity mode and in fast mode, interleaved, warm. `probe`:
    the parity part's of this expert, if it ran (else one is built)."""
    seed, t, scale = EXPERTS[expert]
    print(f"full-size Wan2.2-A14B {expert} speed, {width}x{height} {frames} frames, microgroup 4, CFG {scale}")
    probe = probe or full_probe(expert, device, size, text_len)
    engine, fast = probe.build_engine("wan"), probe.build_engine("none")
    probe.set_inputs(video_inputs(probe.config, 4, text_len, height, width, frames, t, seed, device))
    i, neg = probe.inputs, probe.negative_cond
    ts = FAMILY.train.timestep(i["timestep"], torch.bfloat16)

    def guided(forward, timestep):
        return lambda: guide(FAMILY.guidance, forward, i["hidden_states"], timestep, i["cond"], neg, scale,
                             FAMILY.pipeline.text_streams).output

    def on_engine(model):
        return lambda x, tt, cond: model(hidden_states=x, timestep=tt, grid=i["grid"], **cond)

    def on_train(model):
        return lambda x, tt, cond: train_forward(FAMILY, model, x, tt, i["grid"], cond, backend=probe.train_backend)

    calls = {"diffusers": guided(on_train(probe.train), ts), "engine_parity": guided(on_engine(engine), i["timestep"]),
             "engine_fast": guided(on_engine(fast), i["timestep"])}
    speed: dict = {"frames": frames}
    samples: dict[str, list[float]] = {k: [] for k in calls}

    def interleaved(phase: dict) -> None:
        for fn in phase.values():
            _time(fn, 1)  # warm-up
        for _ in range(reps):
            for k, fn in phase.items():
                samples[k] += _time(fn, 1)

    with torch.no_grad():
        interleaved(calls)
        if compile_baseline:  # a second phase: compiling changes the train side's blocks in place
            probe.train.compile_repeated_blocks(fullgraph=True)  # diffusers' regional compile of WanTransformerBlock
            t1 = time.time()
            _time(guided(on_train(probe.train), ts), 2)
            speed["compile_seconds"] = time.time() - t1
            samples["diffusers_compile"] = []
            interleaved({"diffusers_compile": guided(on_train(probe.train), ts),
                         "engine_parity": calls["engine_parity"], "engine_fast": calls["engine_fast"]})
    base = statistics.median(samples["diffusers"])
    print(f"  one guided step (2 forwards + CFG), microgroup 4, {width}x{height} {frames} frames ({reps} "
          f"interleaved reps):")
    for k, v in samples.items():
        med = statistics.median(v)
        speed[k] = {"median_s": med, "min_s": min(v), "max_s": max(v), "speedup_vs_diffusers": base / med}
        print(f"    {k:18s} median {med * 1e3:9.1f} ms  (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f})  "
              f"{base / med:.2f}x diffusers eager")
    speed["peak_gib"] = _peak()
    return speed


PARTS = ("tiny", "parity", "speed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="tiny,parity,speed", help="what to run, comma-separated: tiny (both layouts' "
                    "tiny checkpoints), parity (full size, per expert), speed (full size, --speed-expert); the GPU "
                    "commands in the docstring split them so each fits a 10-minute slot")
    ap.add_argument("--experts", default="transformer,transformer_2", help="the experts the parity part checks")
    ap.add_argument("--speed-expert", default="transformer", choices=tuple(EXPERTS))
    ap.add_argument("--frames", default="33,81")
    ap.add_argument("--speed-frames", type=int, default=33)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time diffusers with regional torch.compile")
    ap.add_argument("--size", default="full", help="the random architecture (tiny: a quick check of this script)")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    if not parts or not set(parts) <= set(PARTS):
        ap.error(f"--parts takes some of {', '.join(PARTS)}, got {a.parts!r}")
    experts = [e for e in a.experts.split(",") if e]
    if not set(experts) <= set(EXPERTS):
        ap.error(f"--experts takes some of {', '.join(EXPERTS)}, got {a.experts!r}")
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor(),
            "date": time.strftime("%Y-%m-%d"), "argv": argv}
    print(info)
    out = Path(a.out)
    report, ok, kept = {"info": info}, True, None

    def save() -> None:
        out.write_text(json.dumps(report, indent=1))

    if "tiny" in parts:
        report["tiny"], ok = tiny(a.device)
        save()
    if "parity" in parts:
        for expert in experts:
            report[expert] = {}

            def keep(rows: list[dict], expert: str = expert) -> None:
                report[expert]["rows"] = rows
                save()

            report[expert]["rows"], ok_part, probe = full_parity(expert, a.device, a.size,
                                                                 [int(f) for f in a.frames.split(",")], a.height,
                                                                 a.width, a.text_len, keep)
            report[expert]["peak_gib"] = _peak()
            kept = probe if "speed" in parts and expert == a.speed_expert else kept
            del probe
            _free()  # the expert's models, before the next one is built (the speed expert's train side kept)
            ok &= ok_part
            save()
    if "speed" in parts:
        report["speed"] = full_speed(a.speed_expert, a.device, a.size, a.speed_frames, a.height, a.width, a.text_len,
                                     a.reps, a.compile, kept)
        kept = None
        _free()
    report["ok"] = ok
    save()
    print("ALL PARITY CLAIMS HOLD" if ok else "PARITY CLAIM FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
