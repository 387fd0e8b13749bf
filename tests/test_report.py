"""The plots a person reads after a run (axes, labels, units; exact 0.0 shown on the parity plot) and summary.md
embedding them, from metrics records and from a real tiny `trueflow train` run."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from trueflow.train.report import (PARITY_PNG, REWARD_PNG, TIMING_PNG, parity_figure, reward_figure, timing_figure,
                                   write_summary)
from test_metrics import strict_loads


def record(step: int, model: float = 0.0, log_prob: float = 0.0, ratio_dev: float = 0.0,
           reward: float | None = 0.5) -> dict:
    """One metrics.jsonl record as the trainer writes it (None: a value that was non-finite in the run)."""
    return {"step": step, "rollout": step - 1, "reward_mean": reward, "reward_std": None if reward is None else 0.1,
            "model_output_max_abs_diff": model, "log_prob_max_abs_diff": log_prob,
            "ratio_max_abs_dev_from_1": ratio_dev, "ratio_mean": 1.0, "lora_update_norm": 0.01,
            "checksums_equal": True, "time_rollout": 2.0 + step, "time_reward": 0.25, "time_train": 1.5,
            "time_sync": 0.125}


def legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def hollow_x(ax, color: str) -> list[float]:
    """The steps marked by hollow rings (the exact-0.0 marker) of one series' colour."""
    from matplotlib.colors import same_color

    return [x for line in ax.get_lines() if line.get_markerfacecolor() == "none" and line.get_xdata().size
            and same_color(line.get_color(), color) for x in line.get_xdata()]


def test_parity_plot_shows_exact_zeros_on_a_symlog_axis():
    rows = [record(1), record(2, model=2e-3, log_prob=1e-6, ratio_dev=3e-7), record(3),
            record(4, model=0.5, log_prob=0.0)]
    fig = parity_figure(rows)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "optimizer step"
    assert "symlog" in ax.get_ylabel() and "0 = bitwise" in ax.get_ylabel()
    assert ax.get_yscale() == "symlog"
    # Every non-zero value lies on the logarithmic part, above the linear band around 0.
    assert ax.yaxis.get_transform().linthresh <= 3e-7
    lo, hi = ax.get_ylim()
    assert lo < 0.0 and hi >= 0.5
    assert hollow_x(ax, "C0") == [1, 3], "model output exactly 0.0 at steps 1 and 3"
    assert hollow_x(ax, "C1") == [1, 3, 4]
    assert "2 of 4 steps bitwise" in ax.get_title()
    labels = legend_labels(fig)
    assert any("latent units" in s for s in labels) and any("(nats)" in s for s in labels)
    assert any("(unitless)" in s for s in labels) and any("exactly 0.0" in s for s in labels)


def test_parity_plot_of_a_bitwise_run_says_so():
    fig = parity_figure([record(s) for s in (1, 2, 3)])
    (ax,) = fig.axes
    assert ax.get_title() == "Train vs rollout: exactly 0.0 (bitwise) at all 3 steps"
    lo, hi = ax.get_ylim()
    assert lo < 0.0 < hi
    assert list(ax.get_yticks()) == [0.0]
    assert hollow_x(ax, "C0") == [1, 2, 3]


def test_reward_plot_marks_steps_without_a_reward():
    fig = reward_figure([record(1, reward=0.25), record(2, reward=None), record(3, reward=0.75)], "redness")
    (ax,) = fig.axes
    assert ax.get_xlabel() == "optimizer step" and "reward" in ax.get_ylabel()
    assert "redness" in ax.get_title()
    mean, missing = ax.get_lines()[:2]
    np.testing.assert_array_equal(mean.get_ydata(), [0.25, np.nan, 0.75])
    assert list(missing.get_xdata()) == [2]
    assert any("no reward" in s for s in legend_labels(fig))


def test_reward_plot_of_runs_side_by_side_labels_each():
    fig = reward_figure({"synchronous": [record(1, reward=0.25), record(2, reward=0.5)],
                         "--async-rollouts 1": [record(1, reward=0.1), record(2, reward=0.7), record(3, reward=0.9)]},
                        "pickscore")
    (ax,) = fig.axes
    sync, async_ = (line for line in ax.get_lines() if line.get_label() in ("synchronous", "--async-rollouts 1"))
    np.testing.assert_array_equal(sync.get_ydata(), [0.25, 0.5])
    np.testing.assert_array_equal(async_.get_ydata(), [0.1, 0.7, 0.9])
    assert {"synchronous", "--async-rollouts 1"} <= set(legend_labels(fig))
    assert ax.get_xlim() == (0.5, 3.5)  # both runs' steps on one axis


def test_timing_plot_is_in_seconds_per_phase():
    fig = timing_figure([record(1), record(2)])
    (ax,) = fig.axes
    assert ax.get_xlabel() == "optimizer step" and ax.get_ylabel() == "time (s)"
    series = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert series == {"rollout (per rollout)": [3.0, 4.0], "reward (per rollout)": [0.25, 0.25],
                      "train step": [1.5, 1.5], "LoRA sync": [0.125, 0.125]}


CFG = SimpleNamespace(checkpoint="ckpt", reward="redness", rollout_patch_group="qwen_image", num_rollouts=3)


def assert_readable_png(path) -> None:
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width >= 600 and img.height >= 300
        pixels = np.asarray(img.convert("L"))
    assert pixels.std() > 10, f"{path.name} is not blank"


def test_summary_embeds_the_plots_from_the_records(tmp_path):
    """The records come in directly (no metrics.jsonl needed); a null reward is a dash in the table."""
    rows = [record(1), record(2, reward=None), record(3, model=1e-3)]
    summary = write_summary(tmp_path, CFG, rows).read_text()
    for png in (REWARD_PNG, PARITY_PNG, TIMING_PNG):
        assert f"]({png})" in summary
        assert_readable_png(tmp_path / png)
    assert "| 2 | 1 | - | - | 0 |" in summary
    assert "not bitwise at every step" in summary


# -- end to end -------------------------------------------------------------------------------------------------
def half_nan_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Mean brightness in [0, 1], NaN for prompts that start with "bad" (a reward failing on them)."""
    bright = images.float().mean(dim=(1, 2, 3)) / 255.0
    return torch.tensor([math.nan if p.startswith("bad") else b for p, b in zip(prompts, bright.tolist())])


@pytest.mark.slow
def test_a_training_run_writes_strict_json_and_a_summary_with_its_plots(tmp_path, tiny_checkpoint):
    """Rollout 0 has only "bad" prompts: every sample is skipped (`--reward-on-error skip`), so its reward mean
    is NaN in the run - null in metrics.jsonl - and rollout 1 is scored."""
    from test_train import train

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("bad one\nbad two\na red cube\na blue sky\n")
    train(tmp_path, tiny_checkpoint, num_rollouts=2, prompts=str(prompts), reward="test_report:half_nan_reward",
          reward_on_error="skip")
    out = tmp_path / "run"
    rows = [strict_loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] is None for r in rows] == [True, False]
    assert 0.0 <= rows[1]["reward_mean"] <= 1.0
    summary = (out / "summary.md").read_text()
    for png in (REWARD_PNG, PARITY_PNG, TIMING_PNG):
        assert f"]({png})" in summary
        assert_readable_png(out / png)


def test_parity_plot_marks_non_finite_differences():
    """A NaN model output (null in metrics.jsonl) must not vanish from the plot as a gap."""
    fig = parity_figure([record(1), record(2, model=None, log_prob=None), record(3, model=1e-2)])
    (ax,) = fig.axes
    (marker,) = [line for line in ax.get_lines() if line.get_label() == "not finite (NaN or inf)"]
    assert list(marker.get_xdata()) == [2]


@pytest.mark.parametrize("steps", [1, 2, 3, 30])
def test_step_axes_tick_whole_steps(steps):
    """A run of one or two steps too: matplotlib's margins alone leave it no integer to tick but fractions."""
    for make in (reward_figure, parity_figure, timing_figure):
        fig = make([record(s) for s in range(1, steps + 1)])
        fig.canvas.draw()
        (ax,) = fig.axes
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (make.__name__, ticks)
        assert ax.get_xlabel() == "optimizer step" and ax.get_ylabel()


def test_a_sample_grid_names_each_prompt_and_each_reward():
    from trueflow.train.report import sample_grid_figure

    rollout = SimpleNamespace(n_per_prompt=2, prompts=["a red cube", "a fox in the snow"], seed=7,
                              rewards=torch.tensor([0.25, 0.5, math.nan, math.nan]))
    fig = sample_grid_figure(np.zeros((4, 16, 16, 3), np.uint8), rollout, "redness")
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["0.25", "0.5", "skipped", "skipped"]
    assert [ax.get_ylabel() for ax in axes] == ["a red cube", "", "a fox in the snow", ""]
    assert "redness" in fig.get_suptitle() and "seed 7" in fig.get_suptitle()
    unscored = sample_grid_figure(np.zeros((2, 16, 16, 3), np.uint8), SimpleNamespace(**{**vars(rollout),
                                  "rewards": None, "prompts": ["a"]}))
    assert [ax.get_title() for ax in unscored.axes] == ["not scored", "not scored"]


def test_summary_links_the_videos(tmp_path):
    (tmp_path / "samples").mkdir()
    for name in ("rollout-00000-p0.mp4", "rollout-00000-p1.mp4"):
        (tmp_path / "samples" / name).write_bytes(b"")
    summary = write_summary(tmp_path, CFG, [record(1)]).read_text()
    assert "- [rollout-00000-p0](samples/rollout-00000-p0.mp4)" in summary
    assert "- [rollout-00000-p1](samples/rollout-00000-p1.mp4)" in summary


def test_published_files_are_readable_as_any_new_file(tmp_path):
    """safetensors writes 0600; a published file gets what open() gives under this umask (0644 under 022)."""
    from safetensors.torch import save_file

    from trueflow.files import publish

    save_file({"a": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    (tmp_path / "y.txt").write_text("y")
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == 0o600  # the failing side: unpublished
    publish(tmp_path)
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == (tmp_path / "y.txt").stat().st_mode & 0o777
