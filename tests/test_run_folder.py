"""The run folder under faults and neighbours, on checkpoints written by the real writer: its lock (a live holder
refuses a second run and a --resume in one line naming its pid and host; a SIGKILLed holder's lock, a reused pid's
and another boot's are taken over), --keep-checkpoints (the latest is never pruned), and checkpoint writes that fail
(a full disk on a tmpfs, any other write error, a killed run's leftover temporary folder)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trueflow.train import checkpoint as ckpt
from trueflow.train.config import TrainConfig
from trueflow.train.lock import (LOCK_FILE, RunFolderLocked, RunLock, holding_run_lock, lock_run_folder,
                                 takes_lock)

from test_train_errors import assert_one_line_error, train

# A process that holds the lock of the folder argv[1] until its stdin closes.
HOLDER = ("import sys; from trueflow.train.lock import RunLock; lock = RunLock(sys.argv[1]); lock.acquire(); "
          "print('held', flush=True); sys.stdin.read(); lock.release()")


def save(root: Path, step: int, elements: int = 6, keep: int = 0) -> Path:
    """A checkpoint of a one-tensor LoRA of `elements` fp32 values (with its two AdamW moments)."""
    cfg = TrainConfig(output_dir=str(root))
    lora = {"blocks.0.lora_A.weight": torch.full((elements,), float(step))}
    optim = {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros(elements),
                           "exp_avg_sq": torch.zeros(elements)}}, "param_groups": [{"lr": cfg.lr, "params": [0]}]}
    state = {"step": step, "rollout": step, "metrics_lines": step, "config": cfg.to_dict()}
    return ckpt.save_checkpoint(cfg.model_family(), root, step, lora, {"r": 2}, optim, state, keep=keep)


def expected_bytes(elements: int) -> int:
    """What `save(..., elements)` writes in tensors, from their sizes: the LoRA and two moments in fp32, the 0-dim
    step, torch's CPU RNG state (uint8) and numpy's Mersenne Twister key (624 words, stored as int64)."""
    return 3 * 4 * elements + 4 + torch.get_rng_state().numel() + 624 * 8


def steps(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "checkpoints").iterdir() if p.name != "latest")


@pytest.fixture()
def holder(tmp_path):
    """A live process of this host holding the lock of `tmp_path / "run"`."""
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run, proc
    proc.kill()
    proc.wait()


# -- the lock -------------------------------------------------------------------------------------------------------
def test_a_live_holder_refuses_a_second_run_and_a_resume(holder, capsys):
    run, proc = holder
    lock = (run / LOCK_FILE).read_bytes()
    held = json.loads(lock)
    assert (held["pid"], held["host"]) == (proc.pid, socket.gethostname())
    with pytest.raises(RunFolderLocked, match=f"pid {proc.pid} on host {socket.gethostname()}"):
        RunLock(run).acquire()
    for resume in ([], ["--resume"], ["--resume", "auto"]):
        rc, _, err = train(capsys, "--output-dir", str(run), *resume)
        assert_one_line_error(rc, err, f"--output-dir {run} is in use by a running trueflow train",
                              f"pid {proc.pid} on host {socket.gethostname()}", "another --output-dir")
    assert (run / LOCK_FILE).read_bytes() == lock, "a refused run leaves the holder's lock alone"
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert not (run / LOCK_FILE).exists(), "the holder removed its lock"


def test_a_sigkilled_holder_leaves_a_stale_lock_that_is_taken_over(holder):
    run, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == proc.pid, "SIGKILL runs no cleanup"
    lock = RunLock(run)
    with pytest.warns(UserWarning, match=f"its run \\(pid {proc.pid} on host .*\\) is gone"):
        lock.acquire()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / LOCK_FILE).exists()


@pytest.mark.parametrize("change, stale", [
    ({}, False),  # this very process: alive
    ({"start_time": -1}, True),  # its pid now belongs to a process started at another time
    ({"boot_id": "another-boot"}, True),  # written before a reboot
    ({"pid": 2**22 + 1}, True),  # above Linux's pid_max: no such process
])
def test_a_lock_is_alive_only_with_its_pid_boot_and_start_time(tmp_path, change, stale):
    mine = RunLock(tmp_path)
    mine.acquire()
    record = {**json.loads((tmp_path / LOCK_FILE).read_text()), **change}
    mine.me = None  # forget it, so the forged record below is someone else's
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    if stale:
        with pytest.warns(UserWarning, match="is gone"):
            RunLock(tmp_path).acquire()
    else:
        with pytest.raises(RunFolderLocked, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()


def test_a_lock_that_cannot_be_checked_refuses_with_the_fix(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "then"}))
    with pytest.raises(RunFolderLocked, match=f"locked by a run on another host \\(pid 1 on host elsewhere.*delete "
                                              f"{tmp_path / LOCK_FILE}"):
        RunLock(tmp_path).acquire()
    (tmp_path / LOCK_FILE).write_text("garbage")
    with pytest.raises(RunFolderLocked, match="not a lock trueflow wrote.*delete it"):
        RunLock(tmp_path).acquire()


def test_one_process_of_a_run_takes_the_lock_and_releases_it_on_every_way_out(tmp_path, monkeypatch):
    """torchrun's rank 0 takes it, its other ranks (the same run) never look; a Ray run's driver takes it, its
    actors (RANK set, `ray`) run inside it; the entry point releases it when the run fails too."""
    plain, ray = TrainConfig(), TrainConfig(ray=True)
    monkeypatch.delenv("RANK", raising=False)
    assert takes_lock(plain) and takes_lock(ray)  # one process; a Ray driver
    for rank, expected in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert takes_lock(plain) is expected and takes_lock(ray) is False

    seen = []

    @holding_run_lock
    def failing_run(cfg: TrainConfig, folder: Path) -> None:
        lock_run_folder(cfg, folder)
        seen.append((folder / LOCK_FILE).is_file())
        raise ValueError("the run failed")

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="the run failed"):
        failing_run(plain, tmp_path)
    assert seen == [True] and not (tmp_path / LOCK_FILE).exists(), "held during the run, released on its error"
    foreign = json.dumps({"pid": 1, "host": "elsewhere"})  # a lock that refuses whoever looks at it
    (tmp_path / LOCK_FILE).write_text(foreign)
    for rank, cfg in (("1", plain), ("0", ray)):  # torchrun's rank 1; a Ray run's rank-0 actor
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ValueError, match="the run failed"):  # not RunFolderLocked: it never looked
            failing_run(cfg, tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == foreign
    with pytest.raises(RuntimeError, match="outside a @holding_run_lock entry point"):
        lock_run_folder(plain, tmp_path.parent)


# -- pruning --------------------------------------------------------------------------------------------------------
def test_keep_checkpoints_prunes_the_oldest_and_never_the_latest(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep=2)
        assert steps(tmp_path) == [f"step-{s:06d}" for s in range(max(1, step - 1), step + 1)]
    assert ckpt.load_latest(tmp_path)[0].name == "step-000005"
    save(tmp_path, 6, keep=1)
    assert steps(tmp_path) == ["step-000006"], "keep 1: the latest alone"
    for step in range(7, 10):
        save(tmp_path, step, keep=0)  # 0: keep all
    assert steps(tmp_path) == [f"step-{s:06d}" for s in range(6, 10)]
    # A run that resumed from step 7 (8 and 9 damaged, say) names 7 latest: 7 stays, and the checkpoints past it are
    # left for the run to overwrite; only older ones go.
    (tmp_path / "checkpoints" / "latest").write_text("step-000007\n")
    assert ckpt.prune(tmp_path, 1) == [tmp_path / "checkpoints" / "step-000006"]
    assert steps(tmp_path) == ["step-000007", "step-000008", "step-000009"]
    assert ckpt.load_latest(tmp_path)[0].name == "step-000007"


# -- failing writes -------------------------------------------------------------------------------------------------
def test_a_full_disk_is_one_line_and_leaves_the_previous_checkpoint(tmpfs):
    disk = tmpfs(1 << 20)
    first = save(disk, 1, elements=1000)
    elements = 300_000  # 3.6 MB of tensors on a 1 MiB disk
    with pytest.raises(ckpt.CheckpointWriteError) as failed:
        save(disk, 2, elements=elements)
    message = str(failed.value)
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    assert "\n" not in message
    assert message.startswith(f"cannot write checkpoint {disk / 'checkpoints' / 'step-000002'} (the disk is full): "
                              f"it needs about {expected_bytes(elements):,} bytes, {free:,} are free there")
    assert f"the previous checkpoint {first} is intact" in message and "--resume" in message
    assert steps(disk) == ["step-000001"], "no temporary folder is left to keep the disk full"
    path, lora, _, state = ckpt.load_latest(disk)
    assert path == first and state["step"] == 1 and torch.equal(lora["blocks.0.lora_A.weight"], torch.ones(1000))
    save(disk, 2, elements=1000)  # room for a checkpoint of the same size: the run goes on
    assert ckpt.load_latest(disk)[0].name == "step-000002"


def test_a_killed_runs_leftover_temporary_folder_never_fills_the_disk(tmpfs):
    disk = tmpfs(1 << 20)
    save(disk, 1, elements=1000)
    leftover = disk / "checkpoints" / ".tmp-step-000007"  # a run killed while writing step 7 (or pruning)
    leftover.mkdir()
    (leftover / "optimizer.pt").write_bytes(np.random.default_rng(0).bytes(900_000))
    assert os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize < expected_bytes(20_000)
    save(disk, 2, elements=20_000)
    assert steps(disk) == ["step-000001", "step-000002"] and ckpt.load_latest(disk)[0].name == "step-000002"


@pytest.mark.parametrize("where", ["torch.save", "latest"])
def test_any_write_error_is_one_line_and_changes_nothing(tmp_path, monkeypatch, where):
    """A write error that is not a full disk (fault injection in the optimizer file, or in `latest` after the
    rename) names itself; the folder is as before the save."""
    save(tmp_path, 1)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(*(("trueflow.train.checkpoint.torch.save", broken) if where == "torch.save" else
                          ("trueflow.train.checkpoint._atomic_write_text", broken)))
    with pytest.raises(ckpt.CheckpointWriteError, match=r"step-000002 \(OSError: \[Errno 5\] Input/output error\): "
                                                        r"it needs about .* bytes, .* are free there.*step-000001 is "
                                                        "intact"):
        save(tmp_path, 2)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert ckpt.load_latest(tmp_path)[0].name == "step-000001"


def test_a_first_checkpoint_that_fails_says_none_exists(tmp_path, monkeypatch):
    monkeypatch.setattr("trueflow.train.checkpoint.torch.save", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(ckpt.CheckpointWriteError, match="no earlier checkpoint exists: free space and start again "
                                                        "with --resume auto"):
        save(tmp_path, 1)
    assert steps(tmp_path) == []
