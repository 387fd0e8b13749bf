"""LTX-2.3 parity and speed on a CUDA device (issues G2.6 and Q.4): the tiny checkpoint, then the full-size 2.3
architecture (48 layers, 4096-wide video, 2048-wide audio) with seeded random weights, train side diffusers'
`LTX2VideoTransformer3DModel` + PEFT LoRA 64 on the `native` backend, engine under the `ltx` patch group.

    python scripts/gpu_ltx2.py --parts tiny,parity --out $OUT/ltx2_parity.json [--frames 9,33,57]
    python scripts/gpu_ltx2.py --parts speed --out $OUT/ltx2_speed.json   # on an H200: ~6 min, ~110 GiB peak
    python scripts/gpu_ltx2.py --parts speed --size tiny --device cpu --frames 9 --height 64 --width 64 \
        --reps 2 --out x.json                                            # the smoke path

Parts (`--parts`, default all three; each builds its own train side):
1. tiny: the tiny checkpoint, batch 1/4 x text 7/64, bitwise under `ltx`, not under `none`.
2. parity: the full-size architecture, microgroup 4, text 128, LoRA 64, at each `--frames` count after 0, 1, 2 LoRA
   updates; then the ablation (each patch off alone) at the first count.
3. speed: one denoising forward (LTX-2.3 runs unguided: one forward a step) of a microgroup of `--batch` (4) at
   `--width`x`--height` and the last `--frames` count (default 768x512, 57 frames: 3072 tokens a sample), text 128,
   LoRA 64, warm, `--reps` interleaved rounds (each runs every row once), CUDA-event timed:
       diffusers_eager    the train side's call (diffusers + PEFT unmerged), the RoPE coordinates computed once as
                          the pipeline computes them (`_coords_once`)
       diffusers_graph    that call captured whole in one CUDA graph (bitwise eager: checked)
       engine_parity      the engine under `ltx` (its eager-exact kernels), CUDA graphs; bitwise diffusers_eager
       engine_fast        the engine without a group (fast kernels, packed GEMMs, merged LoRA), CUDA graphs
       engine_fast_cudnn  engine_fast with cuDNN attention preferred (an SDPA context its graphs capture)
   then, since compiling changes the model in place, a second phase of rounds (`--no-compile` leaves it out):
       diffusers_compile  diffusers with regional torch.compile (`compile_repeated_blocks(fullgraph=True)`),
                          interleaved with the engine rows again
   Columns: median and min-max ms, TFLOP/s (the forward's GEMM and attention FLOPs, counted by PyTorch's
   `FlopCounterMode` on a meta-device engine forward), speed-up over diffusers eager and over the fastest diffusers
   row, bitwise / max abs diff against diffusers eager; then the issue's goal lines (parity >= 1.2x, fast >= 1.5x
   diffusers eager) and the same against the strongest baseline. A baseline that cannot run is reported, not fatal.

Prints one table per part and writes every result as JSON (rewritten after each part). Exit status 1 if a parity
claim fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from trueflow.checkpoints import init_checkpoint
from trueflow.engine.cuda_graph import GraphedForward, capture
from trueflow.models import get_family
from trueflow.models.ltx2.latents import check_size
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.parity.report import format_ablation
from trueflow.train.model import train_forward

FAMILY = get_family("ltx2")
BF16 = torch.bfloat16
PARITY_GOAL, FAST_GOAL = 1.2, 1.5  # issue Q.4: x diffusers at 768x512x57 frames, microgroup 4


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


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def parity(device: str, size: str, frames_list: list[int], height: int, width: int,
           ablate: bool) -> tuple[dict, bool]:
    print(f"{size} LTX-2.3 architecture, random weights, {width}x{height}, microgroup 4, "
          f"text 128, LoRA rank 64")
    t0 = time.time()
    probe = ParityProbe(ProbeSpec(random_size=size, family="ltx2", batch=4, text_len=128, resolution=64,
                                  lora_rank=64, device=device, layer_report="blocks"))
    print(f"  train side built in {time.time() - t0:.1f} s; "
          f"{_peak():.1f} GiB peak so far")
    rows, ok = [], True
    engine = probe.build_engine("ltx")
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
    ablation = []
    if ablate:
        probe.set_inputs(video_inputs(probe.config, 4, 128, height, width, frames_list[0], 0, device))
        del engine
        results = probe.ablate("ltx")
        print(format_ablation(results))
        ablation = [r.to_json(with_layers=False) for r in results]
    return {"rows": rows, "ablation": ablation, "peak_gib": _peak()}, ok


# -- speed ---------------------------------------------------------------------------------------------------------
BASELINES = ("diffusers_eager", "diffusers_graph", "diffusers_compile")


def _time_once(fn: Callable[[], torch.Tensor], cuda: bool) -> tuple[float, torch.Tensor]:
    """Milliseconds of one call started on an idle device (CUDA events; the host clock without CUDA), and its output."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), out
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def _whole_graph(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`fn` captured in one CUDA graph on its first call (after a warm-up on a side stream); later calls replay it
    and return its static output."""
    state: dict = {}

    def run() -> torch.Tensor:
        if not state:
            state["graph"], state["out"] = capture(fn)
        state["graph"].replay()
        return state["out"]

    return run


def _coords_once(model: torch.nn.Module) -> None:
    """The RoPE coordinates of the diffusers model computed once per shape and reused, as `LTX2Pipeline.__call__`
    computes them before its loop and passes them in (`video_coords`, `audio_coords`): the same values, and the
    host-to-device copies inside `prepare_video_coords` (`torch.tensor(..., device=)`) stay out of a CUDA-graph
    capture."""
    for rope, name in ((model.rope, "prepare_video_coords"), (model.audio_rope, "prepare_audio_coords")):
        prepare, cache = getattr(rope, name), {}

        def once(*args, prepare=prepare, cache=cache, **kwargs):
            key = (args, tuple(sorted(kwargs.items())))
            if key not in cache:
                cache[key] = prepare(*args, **kwargs)
            return cache[key]

        setattr(rope, name, once)


def _cudnn_first():
    """An SDPA context preferring cuDNN attention, then PyTorch's usual order."""
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def forward_flops(config: dict, inputs: dict) -> int:
    """GEMM + attention FLOPs of one forward at these inputs' shapes: PyTorch's `FlopCounterMode` over the engine
    model's forward on the meta device (no memory, no kernels; the isolated video stream, which is diffusers' work
    but for its one-token audio stream)."""
    model = FAMILY.engine.build_model(config, device="meta")
    meta = {k: v.to("meta") for k, v in inputs["cond"].items()}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(hidden_states=inputs["hidden_states"].to("meta"), timestep=inputs["timestep"].to("meta"),
              grid=inputs["grid"], **meta)
    return counter.get_total_flops()


def _phase(name: str, rows: dict[str, Callable[[], torch.Tensor]], cuda: bool, warmup: int, reps: int,
           results: list[dict]) -> dict[str, torch.Tensor]:
    """Warm every row up (graph captures and compilation happen here), then `reps` interleaved rounds; each row's
    result (with its last output, under "output") is appended to `results`. A row other than diffusers_eager and
    engine_parity that raises is recorded with its error and left out. Returns the last outputs."""
    times: dict[str, list[float]] = {}
    outputs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for k, fn in rows.items():
            t0 = time.time()
            try:
                for _ in range(warmup):
                    outputs[k] = fn()
            except Exception as e:  # noqa: BLE001 - a baseline that cannot run here is reported, not fatal
                if k in ("diffusers_eager", "engine_parity"):
                    raise
                print(f"    {k}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
                      flush=True)
                results.append({"row": k, "phase": name, "error": f"{type(e).__name__}: {e}"[:2000]})
                continue
            times[k] = []
            print(f"    {k}: warm in {time.time() - t0:.0f} s", flush=True)
        for _ in range(reps):
            for k in times:
                ms, outputs[k] = _time_once(rows[k], cuda)
                times[k].append(ms)
    for k, v in times.items():
        results.append({"row": k, "phase": name, "times_ms": v, "median_ms": statistics.median(v), "min_ms": min(v),
                        "max_ms": max(v), "output": outputs[k].clone()})
    return outputs


def speed(device: str, size: str, batch: int, height: int, width: int, frames: int, warmup: int,
          reps: int, compile_phase: bool = True) -> tuple[dict, bool]:
    cuda = device.startswith("cuda")
    print(f"speed: {size} LTX-2.3, random weights, one forward of microgroup {batch} at {width}x{height}, {frames} "
          f"frames, text 128, LoRA rank 64; {reps} interleaved rounds after {warmup} warm-up(s)", flush=True)
    t0 = time.time()
    probe = ParityProbe(ProbeSpec(random_size=size, family="ltx2", batch=batch, text_len=128, resolution=64,
                                  lora_rank=64, device=device, layer_report="none"))
    inputs = video_inputs(probe.config, batch, 128, height, width, frames, 0, device)
    grid, cond, hs = inputs["grid"], inputs["cond"], inputs["hidden_states"]
    print(f"  train side built in {time.time() - t0:.0f} s; {grid[0] * grid[1] * grid[2]} tokens a sample", flush=True)
    t_train = FAMILY.train.timestep(inputs["timestep"], BF16)
    train = probe.train
    _coords_once(train)

    def diffusers() -> torch.Tensor:
        return train_forward(FAMILY, train, hs, t_train, grid, cond, backend=probe.train_backend)

    def engine(forward: GraphedForward, ctx: Callable | None = None) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            if ctx is None:
                return forward(hidden_states=hs, timestep=inputs["timestep"], grid=grid, **cond)
            with ctx():  # around capture as well as replay: the graph holds the kernel chosen inside it
                return forward(hidden_states=hs, timestep=inputs["timestep"], grid=grid, **cond)
        return call

    parity_engine = GraphedForward(probe.build_engine("ltx"), enabled=cuda)
    fast_engine = probe.build_engine("none")
    engines = {"engine_parity": engine(parity_engine), "engine_fast": engine(GraphedForward(fast_engine, enabled=cuda))}
    if cuda:
        engines["engine_fast_cudnn"] = engine(GraphedForward(fast_engine), _cudnn_first)
    flops = forward_flops(probe.config, inputs)
    results: list[dict] = []
    rows = {"diffusers_eager": diffusers, **({"diffusers_graph": _whole_graph(diffusers)} if cuda else {}), **engines}
    print("  phase 1 (eager diffusers):", flush=True)
    outputs = _phase("eager", rows, cuda, warmup, reps, results)
    reference = outputs["diffusers_eager"].clone()
    del rows, outputs  # the whole-forward graph's pool goes before compiling
    gc.collect()
    if cuda and compile_phase:
        torch.cuda.empty_cache()
        print("  phase 2 (diffusers compiled in place; its warm-up includes compilation):", flush=True)
        try:
            train.compile_repeated_blocks(fullgraph=True)
        except Exception as e:  # noqa: BLE001 - e.g. a diffusers without regional compilation for this model
            results.append({"row": "diffusers_compile", "phase": "compiled", "error": f"{type(e).__name__}: {e}"})
        else:
            _phase("compiled", {"diffusers_compile": diffusers, **engines}, cuda, warmup, reps, results)
    timed = [r for r in results if "error" not in r]
    for r in timed:
        out = r.pop("output")
        r["bitwise_vs_diffusers_eager"] = torch.equal(out, reference)
        r["max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
    eager = next(r["median_ms"] for r in timed if r["row"] == "diffusers_eager")
    strongest = min((r for r in timed if r["row"] in BASELINES), key=lambda r: r["median_ms"])
    for r in timed:
        r.update({"tflops": flops / (r["median_ms"] * 1e-3) / 1e12,
                  "speedup_vs_diffusers_eager": eager / r["median_ms"],
                  "speedup_vs_strongest": strongest["median_ms"] / r["median_ms"],
                  "tie_vs_strongest": r["min_ms"] <= strongest["max_ms"] and strongest["min_ms"] <= r["max_ms"]})
    head = (f"{'row':18s} {'phase':8s} {'median ms':>10s} {'min-max ms':>19s} {'TFLOP/s':>8s} {'x eager':>8s} "
            f"{'x best':>7s} {'bitwise':>8s} {'max|diff|':>10s}")
    print(f"\n  one forward, microgroup {batch}, {width}x{height}, {frames} frames ({flops / 1e12:.1f} TFLOP); "
          f"strongest diffusers baseline: {strongest['row']}\n  {head}\n  {'-' * len(head)}")
    for r in results:
        if "error" in r:
            print(f"  {r['row']:18s} {r['phase']:8s} FAILED: {r['error'].splitlines()[0][:160]}")
            continue
        print(f"  {r['row']:18s} {r['phase']:8s} {r['median_ms']:10.1f} {r['min_ms']:9.1f}-{r['max_ms']:<9.1f} "
              f"{r['tflops']:8.1f} {r['speedup_vs_diffusers_eager']:8.2f} {r['speedup_vs_strongest']:7.2f} "
              f"{str(r['bitwise_vs_diffusers_eager']):>8s} {r['max_abs_diff']:10.3e}")
    goals = []
    for row, need in (("engine_parity", PARITY_GOAL), ("engine_fast", FAST_GOAL)):
        best = min((r for r in timed if r["row"] == row), key=lambda r: r["median_ms"])
        x = best["speedup_vs_diffusers_eager"]
        goals.append({"row": row, "goal": need, "speedup_vs_diffusers_eager": x, "met": x >= need,
                      "speedup_vs_strongest": best["speedup_vs_strongest"], "strongest": strongest["row"]})
        print(f"  goal: {row} >= {need}x diffusers eager: {x:.2f}x -> {'met' if x >= need else 'missed'}; "
              f"{best['speedup_vs_strongest']:.2f}x the strongest baseline ({strongest['row']})"
              + (" (tie)" if best["tie_vs_strongest"] else ""))
    must = [r for r in timed if r["row"] in ("engine_parity", "diffusers_graph")]  # bitwise by claim
    ok = all(r["bitwise_vs_diffusers_eager"] for r in must)
    print(f"  engine_parity (every phase) and diffusers_graph bitwise diffusers_eager: {ok}")
    return {"shape": {"batch": batch, "height": height, "width": width, "frames": frames, "grid": list(grid)},
            "flops_per_forward": flops, "rows": results, "goals": goals, "peak_gib": _peak()}, ok


def _write(report: dict, path: str) -> None:
    with open(path, "w") as f:  # after every part, so a call cut short keeps what it measured
        json.dump(report, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="tiny,parity,speed", help="comma-separated: tiny, parity, speed")
    ap.add_argument("--no-ablate", action="store_true")
    ap.add_argument("--frames", default="9,33,57", help="parity frame counts; speed runs the last")
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--batch", type=int, default=4, help="the speed part's microgroup")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="speed: leave out the torch.compile phase")
    ap.add_argument("--size", default="full", help="the random architecture (tiny: a quick check of this script)")
    a = ap.parse_args()
    parts = [p for p in a.parts.split(",") if p]
    if not parts or not set(parts) <= {"tiny", "parity", "speed"}:
        ap.error(f"--parts takes tiny, parity and/or speed, got {a.parts!r}")
    try:  # each count a video the pipeline takes, checked before anything is built
        frames = [int(f) for f in a.frames.split(",")]
        for f in frames:
            check_size(a.height, a.width, f)
    except ValueError as e:
        ap.error(f"--frames {a.frames} at --height {a.height} --width {a.width}: {e}")
    info = {"torch": torch.__version__, "python": platform.python_version(), "parts": parts,
            "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor(),
            "date": time.strftime("%Y-%m-%d")}
    print(info)
    report: dict = {"info": info}
    ok = True
    for part in parts:
        if part == "tiny":
            report["tiny"], ok_part = tiny(a.device)
        elif part == "parity":
            report["full"], ok_part = parity(a.device, a.size, frames, a.height, a.width, not a.no_ablate)
        else:
            report["speed"], ok_part = speed(a.device, a.size, a.batch, a.height, a.width, frames[-1], a.warmup,
                                             a.reps, not a.no_compile)
        ok &= ok_part
        _write(report, a.out)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report["ok"] = ok
    _write(report, a.out)
    print("ALL PARITY CLAIMS HOLD" if ok else "PARITY CLAIM FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
