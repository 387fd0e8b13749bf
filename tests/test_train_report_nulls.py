"""The report of a run whose later steps of a rollout did not measure the train/rollout mismatch (null in
metrics.jsonl): not drawn as non-finite, not counted as bitwise or broken, and summary.md says what it measured."""

from __future__ import annotations

from types import SimpleNamespace

from trueflow.train.report import parity_figure, write_summary
from test_report import record

CFG = SimpleNamespace(checkpoint="ckpt", reward="redness", rollout_patch_group="qwen_image", num_rollouts=2)


def unmeasured(step: int) -> dict:
    return {**record(step, model=None, log_prob=None, ratio_dev=None), "ratio_mean": None,
            "parity_measured": False}


def test_unmeasured_steps_are_not_marked_non_finite():
    fig = parity_figure([record(1), unmeasured(2), record(3), unmeasured(4)])
    (ax,) = fig.axes
    assert not [line for line in ax.get_lines() if line.get_label() == "not finite (NaN or inf)"]
    assert ax.get_title() == ("Train vs rollout: exactly 0.0 (bitwise) at all 2 measured steps; 2 later steps of a "
                              "rollout not measured")


def test_summary_says_which_steps_measured_parity(tmp_path):
    text = write_summary(tmp_path, CFG, [record(1), unmeasured(2)]).read_text()
    assert "exactly 0.0 at every measured step (1 of 2" in text and "at every step**" not in text
    assert "| 2 | 1 | 0.50000 | 0.10000 | - | - | - |" in text  # null cells read as dashes


def test_summary_of_a_run_without_steps_claims_nothing(tmp_path):
    assert "parity **not measured** (no steps)" in write_summary(tmp_path, CFG, []).read_text()
    text = write_summary(tmp_path, CFG, [unmeasured(1)]).read_text()
    assert "parity **not measured**" in text and "exactly 0.0" not in text
