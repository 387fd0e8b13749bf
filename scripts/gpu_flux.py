"""FLUX.1-dev parity and speed on one CUDA device (issue 26, the FLUX.1-dev half): the full-size architecture (19
double- and 38 single-stream blocks, 24 heads x 128, guidance embedding) with seeded random weights in bf16, train
side diffusers' `FluxTransformer2DModel` (+ PEFT LoRA, flow_grpo's targets) on `_native_flash`, engine under the
`flux` patch group.

    python scripts/gpu_flux.py --parts parity --out $OUT/flux_parity.json     # on an H200: ~5 min, ~90 GiB peak
    python scripts/gpu_flux.py --parts speed --out $OUT/flux_speed.json       # on an H200: ~8 min, ~80 GiB peak
    python scripts/gpu_flux.py --size tiny --device cpu --shapes 32x1,32x2 --text-len 16 --reps 1 --out f.json
                                                                              # the smoke path (tests run it)

1. parity: at each shape (RESOLUTIONxBATCH; default 512x4 and 1024x4: microgroup 4) with `--text-len` T5 tokens
   (default 512, FluxPipeline's max_sequence_length) and LoRA rank 64, the model output of one distilled-guidance
   step after 0, 1 and 2 LoRA updates (seeded noise on the train side's LoRA, the same update pushed to the engine):
   0.0 under `flux`; the fast engine (`none`) after the same updates: non-zero.
2. speed: one guided denoising step (the recipe's: one distilled-guidance forward of the microgroup, then a flow-GRPO
   SDE step), every row interleaved in one run, `--reps` rounds after a warm-up (graph capture included), CUDA-event
   timed: diffusers eager (`_native_flash`); diffusers with the whole step in one CUDA graph (at `--graph-shapes`,
   default 512x1); diffusers with regional `torch.compile` (`compile_repeated_blocks(fullgraph=True)`, at
   `--compile-shapes`, default 1024x4, in a second phase since compiling changes the model in place); the engine in
   parity mode (`flux`, CUDA graphs) and in fast mode (`none`, CUDA graphs). Each parity row's velocity and next
   latent are checked bitwise against diffusers eager's. Speed shapes: `--speed-shapes` (default 512x1,1024x4).

Prints a table per part and writes everything as JSON to `--out` (rewritten after each part). Exit status 1 if a
parity claim fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from trueflow.engine.cuda_graph import GraphedForward, capture
from trueflow.engine.samplers import sde_step
from trueflow.engine.weights import build_engine_transformer
from trueflow.models.lora import update_lora
from trueflow.models import get_family
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.train.model import train_forward

FAMILY = get_family("flux")
BF16 = torch.bfloat16
STEPS, STEP, NOISE_LEVEL = 6, 1, 0.9  # the recipe's schedule (recipes/flux-dev.yaml); its second step is timed


def parse_shape(text: str) -> tuple[int, int]:
    res, _, batch = text.partition("x")
    granule = FAMILY.pipeline.pixels_per_token
    if not (res.isdigit() and batch.isdigit() and int(res) % granule == 0 and int(batch) > 0):
        raise argparse.ArgumentTypeError(f"shape {text!r} must be RESOLUTIONxBATCH, resolution a multiple of {granule}")
    return int(res), int(batch)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")


def time_once(step: Callable[[], tuple], device: str) -> tuple[float, tuple]:
    """Milliseconds of one step started on an idle device (CUDA events; the host clock elsewhere), and its outputs."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), out
    t0 = time.perf_counter()
    out = step()
    return (time.perf_counter() - t0) * 1e3, out


# -- 1. parity after LoRA updates -----------------------------------------------------------------------------------
def parity(a: argparse.Namespace) -> tuple[list[dict], bool]:
    print(f"parity: {a.size} FLUX.1-dev, random weights, LoRA rank 64, text {a.text_len}, train side _native_flash")
    rows, ok = [], True
    t0 = time.time()
    res0, batch0 = parse_shape(a.shapes[0])
    probe = ParityProbe(ProbeSpec(random_size=a.size, family="flux", batch=batch0, text_len=a.text_len,
                                  resolution=res0, lora_rank=64, device=a.device, layer_report="blocks"))
    print(f"  train side built in {time.time() - t0:.1f} s, {_peak(a.device):.1f} GiB peak so far", flush=True)
    for k, shape in enumerate(a.shapes):
        res, batch = parse_shape(shape)
        probe.set_inputs(FAMILY.probe_inputs(probe.config, batch, a.text_len, res, BF16, k, a.device))
        engines = {"flux": probe.build_engine("flux"), "none": probe.build_engine("none")}
        for updates in range(3):
            if updates:  # the same seeded update on the train side, pushed to both engines
                probe.step_lora(engines["flux"], seed=100 * k + updates)
                update_lora(engines["none"], probe.lora[0], probe.lora[1], None)
            for group, engine in engines.items():
                t1 = time.time()
                r, _ = probe.compare_engine(engine, group)
                want = r.bitwise_equal if group == "flux" else (not r.bitwise_equal and
                                                                r.model_output_max_abs_diff > 0)
                ok &= want
                rows.append({"shape": shape, "text_len": a.text_len, "lora_updates": updates, "group": group,
                             "ok": want, "seconds": time.time() - t1, **r.to_json(with_layers=False)})
                print(f"  {shape:8s} {updates} update(s)  {group:5s} max {r.model_output_max_abs_diff:<10.3e} "
                      f"bitwise {str(r.bitwise_equal):5s} first diff {r.first_differing_module or '-'}"
                      f"{'' if want else '   <- CLAIM FAILED'}", flush=True)
        del engines
        gc.collect()
    print(f"  peak {_peak(a.device):.1f} GiB")
    del probe
    gc.collect()
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows, ok


# -- 2. one guided step, interleaved ---------------------------------------------------------------------------------
class Step:
    """One shape's inputs and the step every row computes: a distilled-guidance forward, then an SDE step."""

    def __init__(self, config: dict, res: int, batch: int, text_len: int, device: str):
        inputs = FAMILY.probe_inputs(config, batch, text_len, res, BF16, 7, device)
        self.x, self.grid = inputs["hidden_states"], inputs["grid"]
        self.cond = {**inputs["cond"], "guidance": torch.full((batch,), 3.5, device=device)}
        sigmas, timesteps = FAMILY.pipeline.schedule(FAMILY.pipeline.scheduler_config, STEPS,
                                                     self.grid[0] * self.grid[1], device)
        self.sigmas, self.t = sigmas, timesteps[STEP].expand(batch).contiguous()
        self.noise = torch.randn(self.x.shape, generator=torch.Generator().manual_seed(8)).to(device)

    def finish(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.sigmas
        return v, sde_step(self.x, v, s[STEP], s[STEP + 1], s[1], NOISE_LEVEL, self.noise, self.x.dtype).x_next

    def diffusers(self, model) -> Callable[[], tuple]:
        ts = FAMILY.train.timestep(self.t, BF16)
        return lambda: self.finish(train_forward(FAMILY, model, self.x, ts, self.grid, self.cond,
                                                 backend="_native_flash"))

    def engine(self, forward) -> Callable[[], tuple]:
        return lambda: self.finish(forward(hidden_states=self.x, timestep=self.t, grid=self.grid, **self.cond))


def whole_step_graph(step: Callable[[], tuple]) -> Callable[[], tuple]:
    """`step` captured in one CUDA graph on its first call; later calls replay it (static outputs)."""
    state = {}

    def run() -> tuple:
        if not state:
            state["graph"], state["out"] = capture(step)
        state["graph"].replay()
        return state["out"]

    return run


def run_rows(rows: dict[str, Callable[[], tuple]], base: str, a: argparse.Namespace) -> dict[str, dict]:
    """Warm every row up, then `--reps` interleaved rounds; each row's times and how its outputs compare with the
    `base` row's."""
    outputs, times = {}, {k: [] for k in rows}
    for name, step in rows.items():
        for _ in range(a.warmup):
            outputs[name] = step()
    for _ in range(a.reps):  # interleaved rounds: slow drifts of the clock hit every row alike
        for name, step in rows.items():
            ms, outputs[name] = time_once(step, a.device)
            times[name].append(ms)
    ref, out = outputs[base], {}
    for name, t in times.items():
        v, x_next = outputs[name]
        out[name] = {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t), "times_ms": t,
                     "base": base, "bitwise_vs_base": bool(torch.equal(v, ref[0]) and torch.equal(x_next, ref[1])),
                     "max_abs_diff_vs_base": (v.float() - ref[0].float()).abs().max().item(),
                     "speedup_vs_base": statistics.median(times[base]) / statistics.median(t)}
    return out


def speed(a: argparse.Namespace) -> tuple[list[dict], bool]:
    cuda = a.device.startswith("cuda")
    config = FAMILY.presets.transformer_config(a.size)
    model = FAMILY.presets.build_transformer(config, seed=0, dtype=BF16, device=a.device).requires_grad_(False)
    engines = {g: GraphedForward(build_engine_transformer(config, model.state_dict(), a.device, BF16, g,
                                                          family="flux"), enabled=cuda) for g in ("flux", "none")}
    results, ok = [], True
    phases = [("eager", a.speed_shapes)] + ([("compiled", a.compile_shapes)] if cuda and a.compile_shapes else [])
    with torch.no_grad():
        for phase, shapes in phases:
            if phase == "compiled":
                model.compile_repeated_blocks(fullgraph=True)  # in place: after every eager row
            for shape in shapes:
                res, batch = parse_shape(shape)
                step = Step(config, res, batch, a.text_len, a.device)
                base = "diffusers_eager" if phase == "eager" else "diffusers_compile"
                rows = {base: step.diffusers(model)}
                if phase == "eager" and cuda and shape in a.graph_shapes:
                    rows["diffusers_graph"] = whole_step_graph(step.diffusers(model))
                rows |= {"engine_parity": step.engine(engines["flux"]), "engine_fast": step.engine(engines["none"])}
                t0 = time.time()
                measured = run_rows(rows, base, a)
                print(f"  {shape} ({phase}, {time.time() - t0:.0f} s):")
                for name, m in measured.items():
                    claim = name == "engine_parity" and phase == "eager"  # compiled diffusers may round otherwise
                    ok &= m["bitwise_vs_base"] or not claim
                    print(f"    {name:17s} median {m['median_ms']:9.2f} ms (min {m['min_ms']:.2f}, max "
                          f"{m['max_ms']:.2f})  {m['speedup_vs_base']:.2f}x {base}  bitwise {m['bitwise_vs_base']}"
                          f"{'   <- CLAIM FAILED' if claim and not m['bitwise_vs_base'] else ''}")
                    results.append({"shape": shape, "phase": phase, "row": name, **m})
                gc.collect()
    return results, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file (rewritten after each part)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="full", help="the random architecture (tiny: the CPU smoke path)")
    ap.add_argument("--parts", default="parity,speed", help="what to run: parity, speed or both (each fits a 10-min "
                                                            "slot on an H200)")
    ap.add_argument("--shapes", default="512x4,1024x4", help="parity shapes, RESOLUTIONxBATCH")
    ap.add_argument("--speed-shapes", default="512x1,1024x4", help="speed shapes ('' for none)")
    ap.add_argument("--graph-shapes", default="512x1", help="shapes with the diffusers CUDA-graph row")
    ap.add_argument("--compile-shapes", default="1024x4", help="shapes of the regional torch.compile phase ('' none)")
    ap.add_argument("--text-len", type=int, default=512, help="T5 tokens (FluxPipeline's max_sequence_length)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    for name in ("shapes", "speed_shapes", "graph_shapes", "compile_shapes"):
        setattr(a, name, [s for s in getattr(a, name).split(",") if s])
        for s in getattr(a, name):
            try:
                parse_shape(s)
            except argparse.ArgumentTypeError as e:
                ap.error(str(e))
    a.parts = [p for p in a.parts.split(",") if p]
    if not set(a.parts) <= {"parity", "speed"} or not a.parts:
        ap.error(f"--parts takes parity, speed or both, got {','.join(a.parts)!r}")
    if not a.shapes or a.warmup < 1 or a.reps < 1:
        ap.error("--shapes needs a shape; --warmup and --reps must be at least 1")
    import diffusers

    cuda = a.device.startswith("cuda")
    info = {"torch": torch.__version__, "diffusers": diffusers.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if cuda else platform.processor(), "size": a.size,
            "text_len": a.text_len, "date": time.strftime("%Y-%m-%d")}
    print(info, flush=True)
    report: dict = {"info": info}
    ok = True
    if "parity" in a.parts:
        report["parity"], ok = parity(a)
        json.dump(report, open(a.out, "w"), indent=1)
    if "speed" in a.parts and a.speed_shapes:
        report["speed"], ok_speed = speed(a)
        ok &= ok_speed
    report["ok"] = ok
    report["peak_gib"] = _peak(a.device)
    json.dump(report, open(a.out, "w"), indent=1)
    print("ALL PARITY CLAIMS HOLD" if ok else "PARITY CLAIM FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
