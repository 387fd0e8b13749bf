"""metrics.jsonl is strict JSON (null for NaN/inf), and the optional Weights & Biases logger, offline."""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest

from trueflow.train.metrics import MetricsWriter, WandbSettings, read_metrics, require_wandb


def strict_loads(line: str):
    """json.loads that refuses NaN / Infinity / -Infinity, as every strict JSON reader does."""
    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def test_strict_loads_refuses_what_python_json_writes_for_nan():
    """The checker itself can fail: Python's default json.dumps writes bare NaN / Infinity."""
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="not JSON"):
            strict_loads(json.dumps({"x": value}))


def test_non_finite_values_are_written_as_null(tmp_path):
    """`--reward-on-error skip` with every sample skipped gives a NaN reward mean: the line stays JSON."""
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.write({"step": 1, "reward_mean": math.nan, "reward_std": math.nan, "loss": 0.1 + 0.2, "checksums_equal": True})
    w.write({"step": 2, "reward_mean": 0.5, "grad_norm": math.inf, "kl": -math.inf, "per_term": [1.5, math.nan],
             "nested": {"a": math.nan, "b": 2}, "trainer_checksum": "abc"})
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert w.lines == 2 and len(lines) == 2
    rows = [strict_loads(line) for line in lines]
    assert rows == [
        {"step": 1, "reward_mean": None, "reward_std": None, "loss": 0.30000000000000004, "checksums_equal": True},
        {"step": 2, "reward_mean": 0.5, "grad_norm": None, "kl": None, "per_term": [1.5, None],
         "nested": {"a": None, "b": 2}, "trainer_checksum": "abc"},
    ]
    assert read_metrics(tmp_path / "metrics.jsonl") == rows


# -- Weights & Biases, offline ---------------------------------------------------------------------------------
def wandb_records(run_dir: Path, timeout: float = 30.0) -> list:
    """The records of a W&B run file (.wandb): W&B's LevelDB-style log of protobuf `Record`s, read here with
    the format's own framing (7-byte file header; 32 KiB blocks of chunks: crc32 u32, length u16, type u8 with
    1 = full, 2 = first, 3 = middle, 4 = last) so the test reads what W&B wrote, not what we asked it to log.
    wandb's `finish()` can return before its writer process has written the file: wait for the `exit` record."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        data, block = path.read_bytes(), 32768
        assert data[:4] == b":W&B"
        pos, chunk, records = 7, b"", []
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
                pos += block - pos % block
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if pos + 7 + n > len(data):
                break  # a chunk still being written
            chunk += data[pos + 7:pos + 7 + n]
            pos += 7 + n
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(chunk)
                records.append(record)
                chunk = b""
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def wandb_history(run_dir: Path) -> list[dict]:
    rows = []
    for r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return rows


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    wandb.teardown()  # wandb keeps the settings of its first run per process (the mode, the folders): reset them


def test_wandb_offline_logs_every_step(wandb_offline):
    run = wandb_offline / "run"
    w = MetricsWriter(run / "metrics.jsonl",
                      wandb=WandbSettings(project="trueflow-test", name="tiny", dir=run, config={"lr": 1e-4}))
    w.write({"step": 1, "reward_mean": 0.25, "model_output_max_abs_diff": 0.0, "checksums_equal": True,
             "trainer_checksum": "abc"})
    w.write({"step": 2, "reward_mean": math.nan, "model_output_max_abs_diff": 0.0, "checksums_equal": True,
             "trainer_checksum": "def"})
    w.close()
    (run_dir,) = (run / "wandb").glob("offline-run-*")
    history = wandb_history(run_dir)
    assert [h["_step"] for h in history] == [1, 2]
    logged = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    # Numbers only (bools as W&B takes them); the NaN reward and the checksum strings are not charted.
    assert logged == [{"step": 1, "reward_mean": 0.25, "model_output_max_abs_diff": 0.0, "checksums_equal": True},
                      {"step": 2, "model_output_max_abs_diff": 0.0, "checksums_equal": True}]
    (run_record,) = [r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    assert {i.key: json.loads(i.value_json) for i in run_record.config.update}["lr"] == 1e-4
    assert (run_record.project, run_record.display_name) == ("trueflow-test", "tiny")
    assert w.wandb_run is None, "close() finished the W&B run"


def test_wandb_missing_is_one_line_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ValueError, match=r"^--wandb needs the wandb package: pip install 'trueflow\[wandb\]'$"):
        require_wandb()
    with pytest.raises(ValueError, match="trueflow\\[wandb\\]"):
        MetricsWriter(tmp_path / "metrics.jsonl", wandb=WandbSettings(dir=tmp_path))


def test_wandb_online_without_an_api_key_is_one_line_with_the_fix(wandb_offline, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"^--wandb: .*wandb login.* WANDB_MODE=offline"):
        MetricsWriter(wandb_offline / "run" / "metrics.jsonl", wandb=WandbSettings(dir=wandb_offline / "run"))


def test_tensorboard_missing_is_one_line_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ValueError, match=r"^--tensorboard needs the tensorboard package: pip install tensorboard$"):
        MetricsWriter(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tensorboard")


def test_every_record_has_an_iso_timestamp_that_run_comparisons_leave_out():
    from datetime import UTC, datetime, timedelta

    import torch

    from trueflow.train.metrics import TIMING_KEYS, step_record

    sync = {"checksums_equal": True, "trainer_checksum": "a", "engine_checksum": "a", "time_sync": 0.1}
    before = datetime.now(UTC)
    record = step_record(1, 0, 0, torch.tensor([0.5]), 0, {"loss": 0.0}, sync, {"time_rollout": 1.0}, 2.0)
    stamp = datetime.fromisoformat(record["timestamp"])
    assert stamp.utcoffset() == timedelta(0) and before - timedelta(seconds=1) <= stamp <= datetime.now(UTC)
    # a wall-clock key like the phase times: left out where two runs' records are compared, and nothing else is
    assert "timestamp" in TIMING_KEYS and all(k.startswith("time") for k in TIMING_KEYS)
    assert set(record) - set(TIMING_KEYS) >= {"step", "reward_mean", "loss", "checksums_equal"}
