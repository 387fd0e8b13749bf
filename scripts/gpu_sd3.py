"""SD3.5-Medium parity and speed on one CUDA device (issue P2, the SD3 half): the full-size MMDiT-X architecture (24
layers, 24 heads x 64, dual attention in layers 0-12) with seeded random weights, train side diffusers'
`SD3Transformer2DModel` + PEFT LoRA as `StableDiffusion3Pipeline` calls it, engine under the `sd3` patch group.

    python scripts/gpu_sd3.py --parts parity --out $OUT/sd3_parity.json   # on an H200: ~4 min, ~45 GiB peak
    python scripts/gpu_sd3.py --parts speed --out $OUT/sd3_speed.json     # on an H200: ~5 min, ~40 GiB peak
    python scripts/gpu_sd3.py --size tiny --device cpu --resolutions 64,128 --out x.json   # the smoke path

Each part builds its own train side (seconds: the weights are drawn on the device), so each fits one 10-minute slot
of the device machine; `--parts parity,speed` (the default) runs both in one process.

1. Parity: a microgroup of 4 with flow_grpo's batched CFG (scale 4.5; the guided output of ONE forward of 8 rows),
   text 77 + 128 tokens (flow_grpo's T5 length), LoRA rank 64 (B drawn non-zero), at each resolution: bitwise after
   0, 1 and 2 LoRA updates under `sd3`, not bitwise under `none`; then the ablation (each patch off alone).
2. Speed, one guided step (the batched CFG forward, `plain_cfg`, a flow-GRPO SDE step), interleaved rounds, warm,
   CUDA-event timed, per shape RESOLUTIONxBATCH (default 512x1 and 1024x4):
       diffusers_eager    the train side's call (diffusers + PEFT unmerged)
       engine_parity      the engine under `sd3`, CUDA graphs (bitwise diffusers_eager: checked on the step)
       engine_fast        the engine under `none` (fast mode), CUDA graphs; not bitwise by design
       diffusers_graph    diffusers' whole step captured in one CUDA graph (512x1: the strongest small baseline)
       diffusers_compile  diffusers with regional torch.compile of every JointTransformerBlock (fullgraph; 1024x4:
                          the strongest large baseline), on its own copy of the model
Prints a table per part and writes every result as JSON (rewritten after each part). Exit status 1 if a parity claim
fails. On a CPU the graph and compile rows are skipped and the times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from trueflow.engine.cuda_graph import GraphedForward, capture
from trueflow.engine.guidance import guide
from trueflow.engine.samplers import sde_step
from trueflow.models import get_family
from trueflow.parity.probe import ParityProbe, ProbeSpec
from trueflow.parity.report import format_ablation
from trueflow.train.model import train_forward

FAMILY = get_family("sd3")
BF16 = torch.bfloat16
TEXT_LEN = 77 + 128  # CLIP's 77 tokens + flow_grpo's max_sequence_length 128 (scripts/train_sd3.py)
CFG = 4.5  # flow_grpo's pickscore_sd3: sample.guidance_scale
BATCH = 4  # the microgroup


def _row(label: str, r, seconds: float) -> dict:
    print(f"  {label:58s} max {r.model_output_max_abs_diff:<10.3e} bitwise {str(r.bitwise_equal):5s} "
          f"first diff {r.first_differing_module or '-'}  ({seconds:.1f} s)")
    return {"case": label, **r.to_json(with_layers=False), "seconds": seconds}


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def _inputs(config: dict, batch: int, resolution: int, seed: int, device: str, text_len: int) -> dict:
    return FAMILY.probe_inputs(config, batch, text_len, resolution, BF16, seed, device)


def parity(probe: ParityProbe, resolutions: list[int], device: str, ablate: bool) -> tuple[dict, bool]:
    rows, ok = [], True
    engine = probe.build_engine("sd3")
    for res in resolutions:
        probe.set_inputs(_inputs(probe.config, probe.spec.batch, res, 0, device, probe.spec.text_len))
        for step in range(3):
            if step:
                probe.step_lora(engine, seed=100 * res + step)
            t0 = time.time()
            r, _ = probe.compare_engine(engine, "sd3")
            rows.append(_row(f"b{probe.spec.batch} {res}px CFG {CFG} LoRA {probe.spec.lora_rank}, after {step} "
                             f"update(s) sd3", r, time.time() - t0))
            ok &= r.bitwise_equal
        t0 = time.time()
        off, _ = probe.run("none")
        rows.append(_row(f"b{probe.spec.batch} {res}px CFG {CFG} LoRA {probe.spec.lora_rank} none", off,
                         time.time() - t0))
        ok &= not off.bitwise_equal
    del engine
    ablation = []
    if ablate:  # at the last resolution, after the updates
        results = probe.ablate("sd3")
        print(format_ablation(results))
        ablation = [r.to_json(with_layers=False) for r in results]
        ok &= results[0].bitwise_equal
    print(f"  peak {_peak():.1f} GiB")
    return {"rows": rows, "ablation": ablation, "peak_gib": _peak()}, ok


# -- speed ---------------------------------------------------------------------------------------------------------
def _guided_step(forward: Callable, inp: dict, negative: dict, noise: torch.Tensor) -> Callable[[], tuple]:
    """One guided step: the family's batched CFG forward, then a flow-GRPO SDE step (sigma 0.8 -> 0.7; the sigmas
    are device tensors made here, so a CUDA-graph capture of the step copies nothing from the host)."""
    x = inp["hidden_states"]
    sigma, sigma_next, sigma_1 = (torch.tensor(s, dtype=torch.float32, device=x.device) for s in (0.8, 0.7, 0.9))

    def step() -> tuple:
        v = guide(FAMILY.guidance, forward, x, inp["timestep"], inp["cond"], negative, CFG,
                  FAMILY.pipeline.text_streams).output
        s = sde_step(x, v, sigma, sigma_next, sigma_1, 0.7, noise, x.dtype)
        return v, s.x_next

    return step


def _time_once(step: Callable[[], tuple], cuda: bool) -> tuple[float, tuple]:
    if cuda:
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


def _whole_step_graph(step: Callable[[], tuple]) -> Callable[[], tuple]:
    state = {}

    def run() -> tuple:
        if not state:
            state["graph"], state["out"] = capture(step)
        state["graph"].replay()
        return state["out"]

    return run


def speed(probe: ParityProbe, shapes: list[tuple[int, int]], device: str, warmup: int, reps: int) -> tuple[list, bool]:
    cuda = device.startswith("cuda")
    config, train, backend = probe.config, probe.train, probe.train_backend
    engines = {g: GraphedForward(probe.build_engine(g), enabled=cuda) for g in ("sd3", "none")}
    compiled = None
    results, ok = [], True
    for res, batch in shapes:
        text_len = probe.spec.text_len
        inp, neg = (_inputs(config, batch, res, seed, device, text_len) for seed in (0, 1))
        neg = neg["cond"]
        noise = torch.randn(inp["hidden_states"].shape, generator=torch.Generator().manual_seed(2)).to(device)
        t_train = FAMILY.train.timestep(inp["timestep"], BF16)
        grid = inp["grid"]

        def diffusers(model, grid=grid):  # this shape's grid
            return lambda x, t, cond: train_forward(FAMILY, model, x, t, grid, cond, backend=backend)

        def engine(fwd, grid=grid):
            return lambda x, t, cond: fwd(hidden_states=x, timestep=t, grid=grid, **cond)

        train_inp = {**inp, "timestep": t_train}
        rows = {"diffusers_eager": _guided_step(diffusers(train), train_inp, neg, noise),
                "engine_parity": _guided_step(engine(engines["sd3"]), inp, neg, noise),
                "engine_fast": _guided_step(engine(engines["none"]), inp, neg, noise)}
        if cuda and (res, batch) == (512, 1):
            rows["diffusers_graph"] = _whole_step_graph(_guided_step(diffusers(train), train_inp, neg, noise))
        if cuda and (res, batch) == (1024, 4):
            if compiled is None:
                compiled = copy.deepcopy(train)
                for block in compiled.transformer_blocks:
                    block.compile(fullgraph=True)
            rows["diffusers_compile"] = _guided_step(diffusers(compiled), train_inp, neg, noise)
        times, outs = {k: [] for k in rows}, {}
        with torch.no_grad():
            for k, fn in list(rows.items()):
                try:
                    for _ in range(warmup):
                        outs[k] = fn()
                except Exception as e:  # a baseline that cannot run here (e.g. torch.compile) is reported, not fatal
                    if k in ("engine_parity", "diffusers_eager"):
                        raise
                    print(f"    {k}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                    results.append({"shape": f"{res}x{batch}", "row": k, "error": f"{type(e).__name__}: {e}"[:2000]})
                    del rows[k], times[k]
            for _ in range(reps):
                for k, fn in rows.items():
                    ms, outs[k] = _time_once(fn, cuda)
                    times[k].append(ms)
        ref = outs["diffusers_eager"]
        bitwise = all(torch.equal(a, b) for a, b in zip(outs["engine_parity"], ref))
        ok &= bitwise
        base = statistics.median(times["diffusers_eager"])
        print(f"  one guided step, {res}x{res} batch {batch} (CFG: one forward of {2 * batch} rows), "
              f"{reps} interleaved rounds; engine_parity bitwise diffusers_eager: {bitwise}")
        for k, v in times.items():
            med = statistics.median(v)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs[k], ref))
            results.append({"shape": f"{res}x{batch}", "row": k, "median_ms": med, "min_ms": min(v),
                            "max_ms": max(v), "speedup_vs_diffusers_eager": base / med, "max_abs_diff": diff})
            print(f"    {k:18s} median {med:9.2f} ms (min {min(v):.2f}, max {max(v):.2f})  {base / med:5.2f}x eager"
                  f"  diff {diff:.3e}")
    return results, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="full", help="the random architecture (tiny: the smoke path)")
    ap.add_argument("--resolutions", default="512,1024", help="parity resolutions")
    ap.add_argument("--shapes", default="512x1,1024x4", help="speed shapes RESOLUTIONxBATCH ('' to skip)")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--batch", type=int, default=BATCH, help="the parity microgroup")
    ap.add_argument("--text-len", type=int, default=TEXT_LEN)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-ablate", action="store_true")
    ap.add_argument("--parts", default="parity,speed", help="what to run: parity, speed or both (each fits a 10-min "
                                                            "slot on an H200)")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    if not parts or not set(parts) <= {"parity", "speed"}:
        ap.error(f"--parts takes parity, speed or both, got {a.parts!r}")
    info = {"torch": torch.__version__, "python": platform.python_version(), "size": a.size,
            "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor(),
            "date": time.strftime("%Y-%m-%d")}
    print(info)
    resolutions = [int(r) for r in a.resolutions.split(",")]
    print(f"{a.size} SD3.5-Medium architecture, random weights, microgroup {a.batch}, text {a.text_len}, CFG {CFG} "
          f"(batched), LoRA rank {a.lora_rank}")
    t0 = time.time()
    probe = ParityProbe(ProbeSpec(random_size=a.size, family="sd3", batch=a.batch, text_len=a.text_len,
                                  resolution=resolutions[0], lora_rank=a.lora_rank, device=a.device,
                                  layer_report="blocks", cfg_scale=CFG))
    print(f"  train side built in {time.time() - t0:.1f} s; {_peak():.1f} GiB peak so far")
    report: dict = {"info": info, "parts": parts}
    ok = True
    if "parity" in parts:
        report["parity"], ok = parity(probe, resolutions, a.device, not a.no_ablate)
        json.dump(report, open(a.out, "w"), indent=1)
    if "speed" in parts and a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        report["speed"], ok_speed = speed(probe, shapes, a.device, a.warmup, a.reps)
        ok &= ok_speed
    report["ok"], report["peak_gib"] = ok, _peak()
    json.dump(report, open(a.out, "w"), indent=1)
    print("ALL PARITY CLAIMS HOLD" if ok else "PARITY CLAIM FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
