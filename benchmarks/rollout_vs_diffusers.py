"""Rollout step time: diffusers' Qwen-Image transformer vs the trueflow engine, on one GPU, in one run.

    python benchmarks/rollout_vs_diffusers.py --out rollout.json [--rows ROW,...] [--shapes 512x1,...]

Unit of work: one guided denoising step = the positive and the negative branch forward (two separate forwards),
true CFG with norm rescale (`models/cfg.py:rescaled_cfg`) and a flow-GRPO SDE step (`engine/samplers.py`), on the
full-size architecture (60 blocks, 24x128 heads, joint dim 3584) with seeded random weights in bf16, text 128
tokens, no mask. Each row is timed with CUDA events around whole steps after `--warmup` steps (which include
any capture or compilation), median of `--repeats`.

Columns: ms/step; TFLOP/s = analytic FLOPs / time; % of the GEMM ceiling (an 8192^3 bf16 matmul measured in
the same run); speed-up over diffusers eager at the same shape; whether the guided velocity is bitwise equal to
diffusers `_native_flash`'s (the train side's kernel) and the max abs difference; peak memory
(`max_memory_allocated`, reset before each row; "+act" is the peak above what was resident at the row's start).

FLOPs of one step (two forwards), counting GEMMs and attention only, with T = S + L tokens (S image, L text),
D = 3072, F = 4D, J = 3584, C = 64 latent channels, P = 64 output channels, N = 60 blocks, batch B:
    2 · 2B · [ N·(T·(4D² + 2DF) + 12D² + 2T²D) + S·C·D + L·J·D + 256·D + D² + 2D² + S·D·P ]
(per block: q/k/v/out and the MLP on every token, the two 6D modulation GEMMs per sample, QKᵀ and PV; then the
input/output projections, the timestep MLP and the final modulation). The outer 2 is two forwards, the next 2
is FLOPs per multiply-add.

Rows (`--rows`, default all; each at the shapes listed, default all four):
    diffusers_eager     diffusers, default attention backend (PyTorch's SDPA choice)
    diffusers_flash     diffusers, `_native_flash` backend: the reference for the bitwise column
    diffusers_graph     diffusers, default backend, the whole step captured in one CUDA graph       (512x1)
    engine_fast         engine, patch group none: Triton kernels, CUDA graphs, cuDNN attention if it runs
    engine_fast_eager   engine_fast without CUDA graphs                                             (512x1)
    engine_fast_torch   engine_fast with the PyTorch fallbacks instead of the Triton kernels       (1024x4)
    engine_parity       engine, patch group qwen_image (flash pinned), CUDA graphs
    diffusers_compile   diffusers, regional torch.compile (compile_repeated_blocks, fullgraph)     (1024x4)
The compile row runs last (it compiles the diffusers model in place), after the engine is freed. The JSON is
rewritten after every row, so a run cut short keeps what it measured. Without CUDA (`--size tiny` smoke run)
the rows that need it are skipped and times come from the host clock.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trueflow import kernels
from trueflow.models.qwen_image.presets import build_transformer, transformer_config
from trueflow.engine.cuda_graph import GraphedForward, capture
from trueflow.models.cfg import rescaled_cfg
from trueflow.engine.samplers import sde_step
from trueflow.models.qwen_image.train import model_timestep
from trueflow.engine.weights import build_engine_transformer
from trueflow.models import apply_patch_group

SHAPES = {"512x1": (512, 1), "512x8": (512, 8), "1024x1": (1024, 1), "1024x4": (1024, 4)}
ROWS: dict[str, tuple[str, ...] | None] = {  # row -> the shapes it runs at (None: all)
    "diffusers_eager": None, "diffusers_flash": None, "diffusers_graph": ("512x1",),
    "engine_fast": None, "engine_fast_eager": ("512x1",), "engine_fast_torch": ("1024x4",),
    "engine_parity": None, "diffusers_compile": ("1024x4",),
}
NEEDS_CUDA = {"diffusers_graph", "diffusers_compile"}
TEXT_LEN, CFG_SCALE, NOISE_LEVEL = 128, 4.0, 0.7
# A mid-schedule SDE step (sigma_1 only matters at sigma = 1); t = 731.2 is not a bf16 number, so the pipeline's
# timestep rounding (the `timestep_dtype` patch) is exercised.
SIGMA, SIGMA_NEXT, SIGMA_1 = 0.7312, 0.6407, 0.97
PIXELS_PER_TOKEN = 16  # VAE factor 8 x patch 2
BF16 = torch.bfloat16


# -- inputs and the step -----------------------------------------------------------------------------------------
@dataclass
class StepInputs:
    x: torch.Tensor  # packed latents [B, S, C] bf16
    pos: torch.Tensor  # positive / negative text embeddings [B, L, J] bf16
    neg: torch.Tensor
    t: torch.Tensor  # schedule timestep [B] fp32 (0..1000)
    noise: torch.Tensor  # [B, S, C] fp32
    sigmas: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # 0-dim fp32 on the device: no host copy per step
    img_shape: tuple[int, int]


def make_inputs(config: dict, resolution: int, batch: int, device: str, seed: int = 0) -> StepInputs:
    g = torch.Generator().manual_seed(seed)
    side = resolution // PIXELS_PER_TOKEN
    s = side * side

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g)

    sig = tuple(torch.tensor(v, dtype=torch.float32, device=device) for v in (SIGMA, SIGMA_NEXT, SIGMA_1))
    c, j = config["in_channels"], config["joint_attention_dim"]
    return StepInputs(randn(batch, s, c).to(device, BF16), randn(batch, TEXT_LEN, j).to(device, BF16),
                      randn(batch, TEXT_LEN, j).to(device, BF16), torch.full((batch,), SIGMA * 1000, device=device),
                      randn(batch, s, c).to(device), sig, (side, side))


def guided_step(pos: torch.Tensor, neg: torch.Tensor, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(guided velocity, next latent)."""
    v = rescaled_cfg(pos, neg, CFG_SCALE)
    return v, sde_step(inp.x, v, *inp.sigmas, NOISE_LEVEL, inp.noise, inp.x.dtype).x_next


def diffusers_step(model, inp: StepInputs) -> Callable[[], tuple]:
    shapes = [(1, *inp.img_shape)] * inp.x.shape[0]

    def branch(text: torch.Tensor) -> torch.Tensor:
        # The timestep as QwenImagePipeline passes it: t.to(bf16) / 1000.
        return model(hidden_states=inp.x, encoder_hidden_states=text, timestep=model_timestep(inp.t, inp.x.dtype),
                     img_shapes=shapes, return_dict=False)[0]

    return lambda: guided_step(branch(inp.pos), branch(inp.neg), inp)


def engine_step(forward, inp: StepInputs) -> Callable[[], tuple]:
    # Keywords, as the model runner calls the engine model (and `GraphedForward` takes them).
    def branch(embeds):
        return forward(hidden_states=inp.x, encoder_hidden_states=embeds, timestep=inp.t, grid=inp.img_shape)

    return lambda: guided_step(branch(inp.pos), branch(inp.neg), inp)


def whole_step_graph(step: Callable[[], tuple]) -> Callable[[], tuple]:
    """`step` captured once in a CUDA graph on its first call (after one warm-up run on a side stream); later
    calls replay it and return the static outputs."""
    state = {}

    def run() -> tuple:
        if not state:
            state["graph"], state["out"] = capture(step)
        state["graph"].replay()
        return state["out"]

    return run


# -- measuring -------------------------------------------------------------------------------------------------------
def step_flops(config: dict, resolution: int, batch: int, text_len: int = TEXT_LEN) -> float:
    """GEMM + attention FLOPs of one guided step (two forwards at `text_len` text tokens); the formula is in the
    module docstring."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    f, j, c = 4 * d, config["joint_attention_dim"], config["in_channels"]
    p = config["patch_size"] ** 2 * config["out_channels"]
    s, L = (resolution // PIXELS_PER_TOKEN) ** 2, text_len
    t = s + L
    block = t * (4 * d * d + 2 * d * f) + 12 * d * d + 2 * t * t * d
    macs = config["num_layers"] * block + s * c * d + L * j * d + 256 * d + d * d + 2 * d * d + s * d * p
    return 2 * 2 * batch * macs


def gemm_ceiling_tflops(n: int = 8192, reps: int = 10) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=BF16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) * 1e-3) / 1e12


def time_once(step: Callable[[], tuple], cuda: bool) -> tuple[float, tuple]:
    """Milliseconds of one step started on an idle device (CUDA events; the host clock without CUDA), and its
    outputs."""
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


def time_steps(step: Callable[[], tuple], warmup: int, repeats: int, cuda: bool) -> tuple[list[float], tuple]:
    """Milliseconds of each of `repeats` steps (each started on an idle device), and the last step's outputs."""
    for _ in range(warmup):
        out = step()
    times = []
    for _ in range(repeats):
        ms, out = time_once(step, cuda)
        times.append(ms)
    return times, out


def cudnn_attention_error(device: str) -> str | None:
    """None if cuDNN's SDPA runs on the engine's layout (a [B, S, H, D] tensor permuted to [B, H, S, D])."""
    if device != "cuda":
        return "no CUDA"
    q = torch.randn(1, 1152, 24, 128, device=device, dtype=BF16).permute(0, 2, 1, 3)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, q, q)
        torch.cuda.synchronize()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0]


def cudnn_first():
    """An SDPA context preferring cuDNN, then PyTorch's usual order (cuDNN alone where `set_priority` is missing)."""
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)


# -- the run ---------------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, config: dict, device: str):
        self.args, self.config, self.device = args, config, device
        self.cuda = device == "cuda"
        self.rows: list[dict] = []
        self.refs: dict[str, torch.Tensor] = {}  # shape -> diffusers `_native_flash` guided velocity
        self.info: dict = {}

    def save(self) -> None:
        with open(self.args.out, "w") as f:
            json.dump({"info": self.info, "rows": self.rows}, f, indent=1)

    def run(self, row: str, shape: str, step: Callable[[], tuple], attention: str, ctx=None, note: str = "") -> bool:
        """Time one row and record it; a row that raises is recorded with its error (the run goes on)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if self.cuda else 0
        t0 = time.perf_counter()
        try:
            with ctx or nullcontext():
                times, (v, _) = time_steps(step, self.args.warmup, self.args.repeats, self.cuda)
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            self.rows.append({"row": row, "shape": shape, "attention": attention, "error": error})
            self.save()
            print(f"  {row:18s} {shape:7s} FAILED {error}", flush=True)
            return False
        peak = torch.cuda.max_memory_allocated() if self.cuda else 0
        ms = statistics.median(times)
        res, batch = SHAPES[shape]
        tflops = step_flops(self.config, res, batch) / (ms * 1e-3) / 1e12
        if row == "diffusers_flash":
            self.refs[shape] = v.clone()
            note = note or "the reference of the bitwise column"
        ref = None if row == "diffusers_flash" else self.refs.get(shape)
        r = {"row": row, "shape": shape, "attention": attention, "ms_per_step": ms, "times_ms": times,
             "tflops": tflops, "pct_gemm_ceiling": 100 * tflops / self.info["gemm_tflops"] if self.cuda else None,
             "bitwise_vs_diffusers_flash": None if ref is None else torch.equal(v, ref),
             "max_abs_diff_vs_diffusers_flash": None if ref is None else (v.float() - ref.float()).abs().max().item(),
             "peak_gib": peak / 2**30, "act_gib": (peak - base) / 2**30, "wall_s": time.perf_counter() - t0,
             "note": note}
        self.rows.append(r)
        self.save()
        print(f"  {row:18s} {shape:7s} {ms:9.2f} ms/step  {tflops:7.1f} TFLOP/s  ({r['wall_s']:.0f} s)", flush=True)
        return True

    def wanted(self, row: str, shape: str) -> bool:
        allowed = ROWS[row]
        return row in self.args.rows and shape in self.args.shapes and (allowed is None or shape in allowed)


def print_table(bench: Bench) -> None:
    eager = {r["shape"]: r["ms_per_step"] for r in bench.rows if r["row"] == "diffusers_eager" and "error" not in r}
    head = (f"{'row':18s} {'shape':7s} {'attention':9s} {'ms/step':>9s} {'TFLOP/s':>8s} {'%GEMM':>6s} "
            f"{'x eager':>7s} {'bitwise':>7s} {'max|dv|':>9s} {'peak GiB':>8s} {'+act':>6s}")
    print("\n" + head + "\n" + "-" * len(head))
    for shape in SHAPES:
        for r in (r for r in bench.rows if r["shape"] == shape):
            if "error" in r:
                print(f"{r['row']:18s} {shape:7s} {r['attention']:9s} FAILED: {r['error']}")
                continue
            pct = "-" if r["pct_gemm_ceiling"] is None else f"{r['pct_gemm_ceiling']:.0f}%"
            speed = f"{eager[shape] / r['ms_per_step']:.2f}" if shape in eager else "-"
            bit = "-" if r["bitwise_vs_diffusers_flash"] is None else str(r["bitwise_vs_diffusers_flash"])
            d = r["max_abs_diff_vs_diffusers_flash"]
            diff = "-" if d is None else f"{d:.2e}"
            print(f"{r['row']:18s} {shape:7s} {r['attention']:9s} {r['ms_per_step']:9.2f} {r['tflops']:8.1f} "
                  f"{pct:>6s} {speed:>7s} {bit:>7s} {diff:>9s} {r['peak_gib']:8.1f} {r['act_gib']:6.1f}"
                  + (f"  ({r['note']})" if r["note"] else ""))
    if bench.cuda:
        print(f"GEMM ceiling (8192^3 bf16 matmul): {bench.info['gemm_tflops']:.0f} TFLOP/s; "
              f"cuDNN attention: {bench.info['cudnn_attention'] or 'yes'}")
    parity = [r.get("bitwise_vs_diffusers_flash") for r in bench.rows if r["row"] == "engine_parity"]
    if parity:
        print("engine_parity bitwise equal to diffusers _native_flash at every shape:", all(parity))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file (rewritten after every row)")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--size", default="full", help="transformer preset (tiny: a CPU smoke run)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    args.rows, args.shapes = args.rows.split(","), args.shapes.split(",")
    bad = sorted(set(args.rows) - set(ROWS)) + sorted(set(args.shapes) - set(SHAPES))
    if bad:
        ap.error(f"unknown rows/shapes: {', '.join(bad)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformer_config(args.size)
    bench = Bench(args, config, device)
    import diffusers  # the benchmark's one diffusers import besides the presets; never in engine code

    bench.info = {"torch": torch.__version__, "diffusers": diffusers.__version__, "python": platform.python_version(),
                  "device": torch.cuda.get_device_name() if bench.cuda else platform.processor(), "size": args.size,
                  "date": time.strftime("%Y-%m-%d"), "triton_kernels": kernels.ENABLED,
                  "gemm_tflops": gemm_ceiling_tflops() if bench.cuda else None,
                  "cudnn_attention": cudnn_attention_error(device)}
    if kernels.HAS_TRITON:
        import triton

        bench.info["triton"] = triton.__version__
    print(bench.info, flush=True)
    from diffusers.models.attention_dispatch import attention_backend

    t0 = time.perf_counter()
    model = build_transformer(config, seed=0, dtype=BF16, device=device).requires_grad_(False)
    print(f"diffusers model built in {time.perf_counter() - t0:.0f} s", flush=True)
    shapes = [s for s in SHAPES if s in args.shapes]
    inputs = {s: make_inputs(config, *SHAPES[s], device) for s in shapes}
    with torch.no_grad():
        # Phase 1: diffusers eager rows, and the `_native_flash` reference of every shape.
        for s in shapes:
            flash = diffusers_step(model, inputs[s])
            if bench.wanted("diffusers_flash", s):
                bench.run("diffusers_flash", s, flash, "flash", attention_backend("_native_flash"))
            else:
                with attention_backend("_native_flash"):
                    bench.refs[s] = flash()[0].clone()
            if bench.wanted("diffusers_eager", s):
                bench.run("diffusers_eager", s, diffusers_step(model, inputs[s]), "default")
            if bench.wanted("diffusers_graph", s) and bench.cuda:
                bench.run("diffusers_graph", s, whole_step_graph(diffusers_step(model, inputs[s])), "default")

        # Phase 2: the engine, built from the same weights.
        engine_rows = [r for r in ROWS if r.startswith("engine") and r in args.rows]
        if engine_rows:
            t0 = time.perf_counter()
            engine = build_engine_transformer(config, model.state_dict(), device, BF16, "none")
            print(f"engine built in {time.perf_counter() - t0:.0f} s", flush=True)
            cudnn = bench.info["cudnn_attention"] is None
            fast_attention, fast_ctx = ("cudnn", cudnn_first) if cudnn else ("default", nullcontext)
            for s in shapes:
                if bench.wanted("engine_fast", s):
                    ok = bench.run("engine_fast", s, engine_step(GraphedForward(engine), inputs[s]), fast_attention,
                                   fast_ctx())
                    if not ok and cudnn:  # e.g. cuDNN attention refused under graph capture: PyTorch's choice
                        bench.run("engine_fast", s, engine_step(GraphedForward(engine), inputs[s]), "default",
                                  note="cuDNN attention failed, see the row above")
                if bench.wanted("engine_fast_eager", s):
                    bench.run("engine_fast_eager", s, engine_step(engine, inputs[s]), fast_attention, fast_ctx())
                if bench.wanted("engine_fast_torch", s):
                    kernels.ENABLED = False
                    try:
                        bench.run("engine_fast_torch", s, engine_step(GraphedForward(engine), inputs[s]),
                                  fast_attention, fast_ctx(), note="PyTorch fp32 fallbacks")
                    finally:
                        kernels.ENABLED = bench.info["triton_kernels"]
            if "engine_parity" in args.rows:
                apply_patch_group(engine, "qwen_image")
                for s in shapes:
                    if bench.wanted("engine_parity", s):
                        bench.run("engine_parity", s, engine_step(GraphedForward(engine), inputs[s]), "flash")
            del engine

        # Phase 3: regional compilation changes the diffusers model in place, so it comes last.
        compile_shapes = [s for s in shapes if bench.wanted("diffusers_compile", s)]
        if compile_shapes and bench.cuda:
            model.compile_repeated_blocks(fullgraph=True)
            for s in compile_shapes:
                bench.run("diffusers_compile", s, diffusers_step(model, inputs[s]), "default",
                          note="warm-up includes compilation")
    skipped = sorted({r for r in args.rows if r in NEEDS_CUDA} if not bench.cuda else ())
    if skipped:
        print("skipped without CUDA:", ", ".join(skipped))
    print_table(bench)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
