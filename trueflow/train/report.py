"""What a person looks at after a run: sample grids, a reward curve, and summary.md with parity per step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .metrics import read_metrics


def write_sample_grid(rollout, path: Path) -> Path:
    """One row per prompt, its samples left to right."""
    images = rollout.images.cpu().numpy()  # [P*n, H, W, 3]
    n, (h, w) = rollout.n_per_prompt, images.shape[1:3]
    p = images.shape[0] // n
    grid = images.reshape(p, n, h, w, 3).transpose(0, 2, 1, 3, 4).reshape(p * h, n * w, 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(grid)).save(path)
    return path


def _plot(values: list[float], path: Path, title: str, size=(480, 240), margin=30) -> None:
    """A line plot with PIL (no plotting dependency)."""
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    xs = [margin + i * (size[0] - 2 * margin) / max(len(values) - 1, 1) for i in range(len(values))]
    ys = [size[1] - margin - (v - lo) / span * (size[1] - 2 * margin) for v in values]
    d.rectangle([margin, margin, size[0] - margin, size[1] - margin], outline="gray")
    d.line(list(zip(xs, ys)), fill="blue", width=2)
    d.text((margin, 8), f"{title}: {lo:.4g} .. {hi:.4g} over {len(values)} steps", fill="black")
    img.save(path)


def write_summary(out: Path, cfg) -> Path:
    rows = read_metrics(out / "metrics.jsonl")
    if rows:
        _plot([r["reward_mean"] for r in rows], out / "reward_curve.png", "reward_mean")
    bitwise = all(r["model_output_max_abs_diff"] == 0.0 for r in rows)
    lines = [
        f"# Training run `{out}`", "",
        f"- checkpoint: `{cfg.checkpoint}`; reward `{cfg.reward}`; patch group `{cfg.rollout_patch_group}`",
        f"- {len(rows)} optimizer steps over {cfg.num_rollouts} rollouts; parity "
        + ("**exactly 0.0 at every step**" if bitwise else "**not bitwise at every step** (see the table)"),
        "", "![reward](reward_curve.png)", "",
        "| step | rollout | reward mean | reward std | model output max diff | log-prob max diff | ratio mean "
        "| ratio max dev | lora update norm | checksums equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['step']} | {r['rollout']} | {r['reward_mean']:.5f} | {r['reward_std']:.5f} | "
                     f"{r['model_output_max_abs_diff']:.3g} | {r['log_prob_max_abs_diff']:.3g} | "
                     f"{r['ratio_mean']:.9f} | {r['ratio_max_abs_dev_from_1']:.3g} | {r['lora_update_norm']:.3g} | "
                     f"{r['checksums_equal']} |")
    samples = sorted((out / "samples").glob("*.png")) if (out / "samples").is_dir() else []
    if samples:
        lines += ["", "Sample grids (one row per prompt):", ""] + [f"![{s.stem}](samples/{s.name})" for s in samples]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
