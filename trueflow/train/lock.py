"""The run folder's lock: one run at a time writes a run folder.

`OUTPUT_DIR/trueflow.lock` holds the holder's pid, host, boot and process start time (JSON). It is taken after the
settings are checked and before anything in the folder is read, and removed when the run ends, whichever way it
ends; a run killed outright (SIGKILL, the OOM killer, a power cut) leaves it behind, and the next run finds its
holder gone and takes it over with a warning. A holder is alive when it runs on this host under the recorded pid,
boot and start time (a pid the kernel gave to another process since, or one from before a reboot, is gone); a
holder on another host cannot be checked from here, so its lock refuses until it is deleted by hand.

One process of a run holds it: the single process, torchrun's rank 0 (the other ranks are the same run and never
look), or the driver of a `--ray` run (whose actors run inside its lock: they carry RANK and `ray`). Taking and
checking the lock are serialized by an flock on the run folder itself, so two runs started together cannot both
take over the same stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .config import TrainConfig

LOCK_FILE = "trueflow.lock"
_held: RunLock | None = None  # the lock of this process's run
_scopes = 0  # entry points (`holding_run_lock`) this process is inside
F = TypeVar("F", bound=Callable[..., Any])


class RunFolderLocked(FileExistsError):
    """The run folder is another live run's (one line naming its holder)."""


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # after "pid (comm) ": the comm may hold spaces


def _me() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(), "start_time": _start_time(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %z"), "token": uuid.uuid4().hex}


def holder_alive(holder: dict) -> bool | None:
    """Whether the process that wrote `holder` still runs: None when it ran on another host (no way to tell)."""
    if holder.get("host") != socket.gethostname():
        return None
    if holder.get("boot_id") and _boot_id() and holder["boot_id"] != _boot_id():
        return False  # the host rebooted since
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user has that pid
        pass
    started = _start_time(pid)
    return holder.get("start_time") is None or started is None or started == holder["start_time"]


@contextlib.contextmanager
def _serialized(folder: Path) -> Iterator[None]:
    """An exclusive flock on the folder while a lock is checked and taken (or released). A file system without
    flock (some network mounts) goes unserialized: the lock file alone still refuses a live holder."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _read(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
        if not isinstance(holder, dict):
            raise ValueError
    except ValueError:
        raise RunFolderLocked(f"{path} is not a lock trueflow wrote ({text[:80]!r}): if no run uses "
                              f"{path.parent}, delete it") from None
    return holder


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"


class RunLock:
    """The lock of one run folder, held by this process from `acquire` to `release`."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.me: dict | None = None

    def acquire(self) -> None:
        """Take the lock, or raise RunFolderLocked naming the live holder; a dead holder's lock is taken over with
        a warning."""
        with _serialized(self.folder):
            holder = _read(self.path)
            if holder is not None:
                alive = holder_alive(holder)
                if alive is None:
                    raise RunFolderLocked(
                        f"--output-dir {self.folder} is locked by a run on another host ({_describe(holder)}): if "
                        f"that run is over, delete {self.path}; else wait for it, or use another --output-dir")
                if alive:
                    raise RunFolderLocked(f"--output-dir {self.folder} is in use by a running trueflow train "
                                          f"({_describe(holder)}): wait for it to end, or use another --output-dir")
                warnings.warn(f"{self.path}: its run ({_describe(holder)}) is gone (killed?); taking the run "
                              "folder over", stacklevel=3)
            me = _me()
            tmp = self.path.with_name(f".{LOCK_FILE}.{me['pid']}.tmp")
            tmp.write_text(json.dumps(me) + "\n")
            os.replace(tmp, self.path)
            self.me = me

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        if self.me is None:
            return
        with _serialized(self.folder):
            with contextlib.suppress(RunFolderLocked):
                holder = _read(self.path)
                if holder is not None and holder.get("token") == self.me["token"]:
                    self.path.unlink()
        self.me = None


def takes_lock(cfg: TrainConfig) -> bool:
    """Whether this process holds its run's lock: not a torchrun rank other than 0, not a Ray actor (its driver
    holds it)."""
    if "RANK" in os.environ:
        return os.environ["RANK"] == "0" and not cfg.ray
    return True


def lock_run_folder(cfg: TrainConfig, folder: Path) -> None:
    """Take `folder`'s lock for this process's run if this process is the one that holds it (`takes_lock`); the
    run's entry point (`holding_run_lock`) releases it."""
    global _held
    if not takes_lock(cfg):
        return
    if not _scopes:
        raise RuntimeError("lock_run_folder outside a @holding_run_lock entry point: nothing would release it")
    if _held is not None:
        raise RuntimeError(f"this process already holds {_held.path}: one run at a time per process")
    lock = RunLock(folder)
    lock.acquire()
    _held = lock


def holding_run_lock(fn: F) -> F:
    """Make `fn` a run's entry point: the run folder lock taken inside it is released on every way out of it."""
    @functools.wraps(fn)
    def entry(*args, **kwargs):
        global _held, _scopes
        _scopes += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _scopes -= 1
            if _held is not None and not _scopes:
                _held.release()
                _held = None
    return entry  # type: ignore[return-value]
