"""`benchmarks/grpo_step.py --size tiny`: the CPU smoke runs of the whole-GRPO-step benchmark, Qwen-Image and LTX-2.3.
Both loops (`trueflow train` through its Python API, and the flow_grpo-style diffusers + PEFT loop) run a warm-up and
one measured step; the JSON holds every phase of every step, trueflow's rows are bitwise (mismatch exactly 0.0), and
the FLOP count follows the formula of `rollout_vs_diffusers.py`'s docstring (Qwen-Image) or the one written out here
(LTX-2.3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "grpo_step.py"
PHASES = ("rollout", "reward", "train", "sync")
# One intra-op thread: the tiny shapes gain nothing from two, and on a busy 2-core machine two threads spin.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "grpo_step.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--out", str(out), *args], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else None


def tiny_forward_flops(text_len: int, batch: int, resolution: int = 64) -> int:
    """The docstring formula of rollout_vs_diffusers.py for one forward of the tiny transformer (2 blocks, 2 heads
    of 32, joint dim 48, 64 in / 16x4 out channels)."""
    n, d, j, c, p = 2, 64, 48, 64, 64
    f, s = 4 * d, (resolution // 16) ** 2
    t = s + text_len
    block = t * (4 * d * d + 2 * d * f) + 12 * d * d + 2 * t * t * d
    return 2 * batch * (n * block + s * c * d + text_len * j * d + 256 * d + d * d + 2 * d * d + s * d * p)


def test_smoke_run(tmp_path):
    proc, result = run(tmp_path, "--resolution", "64", "--rollouts", "2", "--prompts", "1",
                       "--workdir", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info, rows, summary = result["info"], result["rows"], result["summary"]
    assert info["size"] == "tiny" and info["recipe"]["group"] == 8 and info["recipe"]["num_sde_steps"] == 2
    assert info["trueflow_hooks_missing"] == [] and len(info["trueflow_hooks"]) == 5
    lens = info["text_lengths"]
    by_loop = {loop: [r for r in rows if r["loop"] == loop] for loop in ("trueflow", "baseline")}
    for loop, loop_rows in by_loop.items():
        assert [(r["rollout"], r["warmup"]) for r in loop_rows] == [(0, True), (1, False)], loop
        for r in loop_rows:
            assert r["images"] == 8 and r["step_s"] > 0 and r["images_per_gpu_s"] == r["images"] / r["step_s"]
            assert all(isinstance(r[f"time_{p}"], float) and r[f"time_{p}"] >= 0 for p in PHASES), r
            (prompt,) = r["prompts"]
            both = tiny_forward_flops(lens[prompt], 8) + tiny_forward_flops(lens[" "], 8)
            assert r["flops_rollout"] == 10 * both  # 10 steps x 2 branches x 8 samples
            assert r["flops_train"] == 2 * 3 * both  # 2 SDE steps x (forward + backward at 2x)
            assert r["flops_reward"] > 0 and r["flops_sync"] is None
            for p in ("rollout", "reward", "train"):
                assert r[f"tflops_{p}"] == r[f"flops_{p}"] / r[f"time_{p}"] / 1e12
    for r in by_loop["trueflow"]:
        assert r["model_output_max_abs_diff"] == 0.0 and r["checksums_equal"] is True, r
    for r in by_loop["baseline"]:
        assert r["time_sync"] == 0.0 and r["model_output_max_abs_diff"] is None
    # the same prompts, so the same work, in both loops
    assert [r["prompts"] for r in by_loop["trueflow"]] == [r["prompts"] for r in by_loop["baseline"]]
    for loop, loop_rows in by_loop.items():
        s = summary[loop]
        assert s["measured_steps"] == 1 and s["step_s"] == loop_rows[1]["step_s"]  # the warm-up is left out
        assert s["images_per_gpu_s"] == 8 / loop_rows[1]["step_s"]
    assert summary["speedup_images_per_gpu_s"] == (summary["trueflow"]["images_per_gpu_s"]
                                                   / summary["baseline"]["images_per_gpu_s"])
    assert [p["images_per_gpu_s"] for p in result["peers"]] == [0.305, 0.51]
    assert "0.305 images/GPU/s" in proc.stdout and "trueflow / baseline images/GPU/s" in proc.stdout


def tiny_ltx2_forward_flops(tokens: int, batch: int, text_len: int = 512) -> int:
    """One forward of the tiny LTX-2.3 transformer (2 blocks, 2 heads of 16, 16 latent channels, text width 32, gated
    attention, cross-attention modulation), multiply-adds x 2: proj_in, the two timestep embedders (256 -> D -> D,
    then 9 and 2 modulation rows), and per block the packed q/k/v/gate GEMM, the text attention's q/gate on the video
    and k/v on the text, both output projections, the 4x MLP and both attentions' QK^T and PV; proj_out."""
    c, d, h, n, dc, s, L = 16, 32, 2, 2, 32, tokens, text_len
    block = (s * d * (3 * d + h) + s * d * d + 2 * s * s * d + s * d * (d + h) + L * dc * 2 * d + s * d * d
             + 2 * s * L * d + 8 * s * d * d)
    embedders = (256 * d + d * d + 9 * d * d) + (256 * d + d * d + 2 * d * d)
    return 2 * batch * (s * c * d + embedders + n * block + s * d * c)


def test_ltx2_smoke_run(tmp_path):
    """LTX-2.3 videos (64x64, 9 frames: 2 x 2 x 2 tokens), unguided, the same loops and accounting."""
    proc, result = run(tmp_path, "--family", "ltx2", "--resolution", "64", "--width", "64", "--num-frames", "9",
                       "--rollouts", "2", "--prompts", "1", "--workdir", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info, rows, summary = result["info"], result["rows"], result["summary"]
    recipe = info["recipe"]
    assert (recipe["family"], recipe["resolution"], recipe["width"], recipe["num_frames"]) == ("ltx2", 64, 64, 9)
    assert recipe["cfg_scale"] == 1.0 and recipe["attention_backend"] == "native"
    cfg = info["trueflow_config"]
    assert (cfg["resolution"], cfg["width"], cfg["num_frames"], cfg["rollout_patch_group"]) == (64, 64, 9, "ltx")
    assert set(info["text_lengths"].values()) == {512}  # LTX2Pipeline pads every prompt to max_sequence_length
    by_loop = {loop: [r for r in rows if r["loop"] == loop] for loop in ("trueflow", "baseline")}
    one = tiny_ltx2_forward_flops(2 * 2 * 2, 8)
    for loop, loop_rows in by_loop.items():
        assert [(r["rollout"], r["warmup"]) for r in loop_rows] == [(0, True), (1, False)], loop
        for r in loop_rows:
            assert r["images"] == 8 and r["flops_rollout"] == 10 * one and r["flops_train"] == 2 * 3 * one, r
            assert r["flops_reward"] > 0
    for r in by_loop["trueflow"]:
        assert r["model_output_max_abs_diff"] == 0.0 and r["checksums_equal"] is True, r
    assert [r["prompts"] for r in by_loop["trueflow"]] == [r["prompts"] for r in by_loop["baseline"]]
    assert "speedup_images_per_gpu_s" in summary and "goal_2x_met" not in summary  # the 2x goal is Qwen-Image's
    assert [p["images_per_gpu_s"] for p in result["peers"]] == [round(64 / 252 / 5, 4)]


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    """In this process (`main(argv)`, the script's own entry): exit 2, one line naming the fix, no JSON written."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import grpo_step
    finally:
        sys.path.remove(str(SCRIPT.parent))
    out = tmp_path / "grpo_step.json"
    tiny = ("--size", "tiny")
    cases = (((*tiny, "--rollouts", "1"), "--rollouts 1"), ((*tiny, "--resolution", "100"), "multiple of 16"),
             ((*tiny, "--width", "96"), "--width and --num-frames are ltx2's"),
             ((*tiny, "--family", "ltx2", "--num-frames", "8"), "8k + 1"),
             ((*tiny, "--family", "ltx2", "--resolution", "80"), "--resolution 80: must be a positive multiple of 32"),
             (("--size", "full", "--family", "ltx2", "--width", "512"),
              "the full-size ltx2 recipe runs at 768x512, 33 frames"),
             ((*tiny, "--family", "ltx2", "--train-kernels", "fused"), "--train-kernels fused is Qwen-Image's"))
    for args, needle in cases:
        assert grpo_step.main(["--out", str(out), *args]) == 2, args
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
