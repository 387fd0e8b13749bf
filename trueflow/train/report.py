"""What a person looks at after a run: sample grids, reward / parity / timing plots (PNG, matplotlib), and
summary.md with the plots and parity per step."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from .metrics import read_metrics

REWARD_PNG, PARITY_PNG, TIMING_PNG = "reward_curve.png", "parity_diff.png", "timing.png"

# (metrics key, legend label with the unit): the train-vs-rollout differences of one optimizer step.
PARITY_SERIES = (
    ("model_output_max_abs_diff", "model output (guided velocity, latent units)"),
    ("log_prob_max_abs_diff", "log-prob (nats)"),
    ("ratio_max_abs_dev_from_1", "|ratio - 1| (unitless)"),
)
TIMING_SERIES = (
    ("time_rollout", "rollout (per rollout)"),
    ("time_reward", "reward (per rollout)"),
    ("time_train", "train step"),
    ("time_sync", "LoRA sync"),
)


def write_sample_grid(rollout, path: Path, reward_name: str = "reward") -> Path:
    """The rollout's `sample_grid_figure` as a PNG. A video rollout's grid shows each sample's middle frame, and each
    prompt's first sample is written beside it as an MP4 (`<grid>-p<prompt>.mp4`)."""
    images = rollout.images.cpu()
    if images.ndim == 5:  # [P*n, F, H, W, 3]
        from ..video import write_mp4

        n = rollout.n_per_prompt
        for p in range(images.shape[0] // n):
            write_mp4(images[p * n], path.with_name(f"{path.stem}-p{p}.mp4"), rollout.params.fps)
        images = images[:, images.shape[1] // 2]
    path.parent.mkdir(parents=True, exist_ok=True)
    sample_grid_figure(images.numpy(), rollout, reward_name).savefig(path)
    return path


def sample_grid_figure(images: np.ndarray, rollout, reward_name: str = "reward") -> Figure:
    """One row per prompt (the prompt at its left), its samples left to right, each titled with its reward (or
    "skipped" where the reward skipped the prompt's group, "not scored" where no reward ran). `images`: uint8
    `[P*n, H, W, 3]`."""
    n = rollout.n_per_prompt
    rows, (h, w) = images.shape[0] // n, images.shape[1:3]
    rewards = [None] * len(images) if rollout.rewards is None else rollout.rewards.float().cpu().tolist()
    # A cell shows the image at about its own pixels, within 1.5-3 inches at the figure's 110 dpi.
    side = min(3.0, max(1.5, max(h, w) / 110))
    fig = Figure(figsize=(side * n + 2.2, side * rows * h / w + 0.9), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"{reward_name} of each sample (seed {rollout.seed}); one row per prompt", fontsize=9)
    axes = fig.subplots(rows, n, squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.imshow(images[i], interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        r = rewards[i]
        ax.set_title("not scored" if r is None else "skipped" if not np.isfinite(r) else f"{r:.4g}", fontsize=8)
        if i % n == 0:
            ax.set_ylabel(textwrap.fill(rollout.prompts[i // n], 24), fontsize=8, rotation=0, ha="right", va="center")
    return fig


def _column(rows: list[dict], key: str) -> np.ndarray:
    """One metric over the steps as floats, NaN where the record has null (a non-finite value) or lacks it."""
    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


def _measured(rows: list[dict]) -> np.ndarray:
    """Which steps measured the train/rollout mismatch: a rollout's later steps do only with
    `parity_on_every_step` (records from before the flag existed measured every step)."""
    return np.array([r.get("parity_measured", True) for r in rows], dtype=bool)


def _figure(title: str, ylabel: str) -> tuple[Figure, Axes]:
    # Figure + Agg canvas, not pyplot: no global figure state, no GUI backend, safe off the main thread.
    fig = Figure(figsize=(7.5, 4.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.grid(True, alpha=0.3)
    return fig, ax


def _steps_axis(ax: Axes, steps: np.ndarray) -> None:
    """Half a step of room each side: matplotlib's own margins around one or two steps leave no integer to tick
    but the steps themselves, and it then falls back to fractional ticks."""
    if steps.size:
        ax.set_xlim(np.nanmin(steps) - 0.5, np.nanmax(steps) + 0.5)


def _legend(fig: Figure, steps: np.ndarray) -> Figure:
    _steps_axis(fig.axes[0], steps)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)  # below the axes: never over the data
    return fig


def reward_figure(rows: list[dict] | dict[str, list[dict]], reward_name: str = "reward") -> Figure:
    """Mean reward per optimizer step with a ±1 std band; steps without any reward (every group skipped after a
    reward failure: null in metrics.jsonl) are marked on the x axis instead of silently left out. Given runs by
    label (`{"synchronous": rows, ...}`), one line and band per run on the same axes."""
    runs = rows if isinstance(rows, dict) else {"mean over the rollout's scored samples": rows}
    fig, ax = _figure(f"Reward ({reward_name}) per optimizer step", "reward (score of the reward function)")
    all_steps = []
    for i, (label, run) in enumerate(runs.items()):
        color = f"C{i}"  # matplotlib's colour cycle: as many runs as are given
        steps, mean, std = _column(run, "step"), _column(run, "reward_mean"), _column(run, "reward_std")
        all_steps.append(steps)
        ax.plot(steps, mean, "o-", ms=3, color=color, label=label)
        band = np.isfinite(mean) & np.isfinite(std)
        if band.any():
            ax.fill_between(steps, mean - std, mean + std, where=band, color=color, alpha=0.2,
                            label="± 1 std" + ("" if len(runs) == 1 else f" ({label})"))
        missing = ~np.isfinite(mean)
        if missing.any():
            ax.plot(steps[missing], np.zeros(missing.sum()), "x", color="tab:red", ms=8, mew=2,
                    transform=ax.get_xaxis_transform(), clip_on=False, label="no reward (all samples skipped)")
    return _legend(fig, np.concatenate(all_steps))


def parity_figure(rows: list[dict]) -> Figure:
    """The train-vs-rollout differences per step on a symlog axis: exact 0.0 (the bitwise case, which a log axis
    cannot show) sits on the 0 line with its own hollow marker, positive values are logarithmic above it, and a
    step with a non-finite difference is marked at the top."""
    steps, measured = _column(rows, "step"), _measured(rows)
    series = [(_column(rows, key), label) for key, label in PARITY_SERIES]
    values = np.concatenate([v for v, _ in series])
    positive = values[np.isfinite(values) & (values > 0)]
    exact = int(np.sum(series[0][0] == 0))
    n, which = int(measured.sum()), "steps" if measured.all() else "measured steps"
    if positive.size:
        title = f"Train vs rollout: max |difference| per step ({exact} of {n} {which} bitwise)"
        ylabel = "max |train - rollout| (symlog; 0 = bitwise)"
    else:
        title = f"Train vs rollout: exactly 0.0 (bitwise) at all {n} {which}"
        ylabel = "max |train - rollout|"
    if not measured.all():
        title += f"; {int((~measured).sum())} later steps of a rollout not measured"
    fig, ax = _figure(title, ylabel)
    if positive.size:
        # Linear only below the smallest difference seen, so every non-zero value is on the log part of the axis.
        linthresh = 10.0 ** np.floor(np.log10(positive.min()))
        ax.set_yscale("symlog", linthresh=linthresh, linscale=0.5)
        ax.set_ylim(-linthresh * 0.5, positive.max() * 10)
    else:  # nothing but zeros: a plain axis with the one value there is
        ax.set_ylim(-1, 1)
        ax.set_yticks([0], ["0.0"])
    for i, (v, label) in enumerate(series):
        color = f"C{i}"
        ax.plot(steps, v, "o-", ms=3, color=color, label=label)
        zeros = v == 0
        if zeros.any():  # concentric rings, so zeros of all three series stay visible
            ax.plot(steps[zeros], v[zeros], "o", ms=11 - 3 * i, mfc="none", mew=1.5, color=color)
    ax.plot([], [], "o", ms=8, mfc="none", color="gray", label="ring: exactly 0.0 (bitwise)")
    broken = measured & ~np.all([np.isfinite(v) for v, _ in series], axis=0)
    if broken.any():  # NaN/inf in the run (null in metrics.jsonl): the worst case, so shown, at the top
        ax.plot(steps[broken], np.ones(broken.sum()), "v", color="tab:red", ms=8,
                transform=ax.get_xaxis_transform(), clip_on=False, label="not finite (NaN or inf)")
    ax.axhline(0.0, color="black", lw=0.8)
    return _legend(fig, steps)


def timing_figure(rows: list[dict]) -> Figure:
    """Wall-clock seconds per step, by phase. A rollout's times repeat on each of its optimizer steps."""
    steps = _column(rows, "step")
    fig, ax = _figure("Wall-clock time per optimizer step", "time (s)")
    for key, label in TIMING_SERIES:
        v = _column(rows, key)
        if np.isfinite(v).any():
            ax.plot(steps, v, "o-", ms=3, label=label)
    ax.set_ylim(bottom=0)
    return _legend(fig, steps)


def write_plots(rows: list[dict], out: Path, reward_name: str = "reward") -> list[Path]:
    """reward_curve.png, parity_diff.png and timing.png in `out`, from the metrics records."""
    out.mkdir(parents=True, exist_ok=True)
    figures = {REWARD_PNG: reward_figure(rows, reward_name), PARITY_PNG: parity_figure(rows),
               TIMING_PNG: timing_figure(rows)}
    for name, fig in figures.items():
        fig.savefig(out / name)
    return [out / name for name in figures]


def _fmt(value, spec: str) -> str:
    """A table cell; null (non-finite in the run) reads as a dash."""
    return "-" if value is None else format(value, spec)


def _parity_sentence(rows: list[dict]) -> str:
    measured = [r for r, m in zip(rows, _measured(rows)) if m]
    if not measured:
        return "parity **not measured** (no step measured it)" if rows else "parity **not measured** (no steps)"
    where = "every step" if len(measured) == len(rows) else (
        f"every measured step ({len(measured)} of {len(rows)}: a rollout's later steps train on moved weights and "
        "measure it only with --parity-on-every-step)")
    if all(r["model_output_max_abs_diff"] == 0.0 for r in measured):
        return f"parity **exactly 0.0 at {where}**"
    return f"parity **not bitwise at {where}** (see the table)"


def write_summary(out: Path, cfg, rows: list[dict] | None = None) -> Path:
    """summary.md for the run in `out`, its plots beside it as PNGs. `rows`: the metrics records (read from
    out/metrics.jsonl when None)."""
    rows = read_metrics(out / "metrics.jsonl") if rows is None else rows
    lines = [
        f"# Training run `{out}`", "",
        f"- checkpoint: `{cfg.checkpoint}`; reward `{cfg.reward}`; patch group `{cfg.rollout_patch_group}`",
        f"- {len(rows)} optimizer steps over {cfg.num_rollouts} rollouts; {_parity_sentence(rows)}",
    ]
    if rows:
        write_plots(rows, out, cfg.reward)
        lines += ["", f"![reward per optimizer step]({REWARD_PNG})", "",
                  f"![train vs rollout difference per optimizer step]({PARITY_PNG})", "",
                  f"![wall-clock time per optimizer step]({TIMING_PNG})"]
    lines += [
        "", "| step | rollout | reward mean | reward std | model output max diff | log-prob max diff | ratio mean "
        "| ratio max dev | lora update norm | checksums equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['step']} | {r['rollout']} | {_fmt(r['reward_mean'], '.5f')} | "
                     f"{_fmt(r['reward_std'], '.5f')} | {_fmt(r['model_output_max_abs_diff'], '.3g')} | "
                     f"{_fmt(r['log_prob_max_abs_diff'], '.3g')} | {_fmt(r['ratio_mean'], '.9f')} | "
                     f"{_fmt(r['ratio_max_abs_dev_from_1'], '.3g')} | {_fmt(r['lora_update_norm'], '.3g')} | "
                     f"{r['checksums_equal']} |")
    samples = sorted((out / "samples").glob("*.png")) if (out / "samples").is_dir() else []
    if samples:
        lines += ["", "Sample grids (one row per prompt, each sample titled with its reward):", ""]
        lines += [f"![{s.stem}](samples/{s.name})" for s in samples]
    videos = sorted((out / "samples").glob("*.mp4")) if (out / "samples").is_dir() else []
    if videos:
        lines += ["", "Videos (each prompt's first sample, H.264 MP4):", ""]
        lines += [f"- [{v.stem}](samples/{v.name})" for v in videos]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
