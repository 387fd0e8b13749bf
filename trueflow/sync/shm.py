"""Shared-memory segments that carry CPU weight buckets by name to another process of this machine (`engine.wire`).

torch's `file_system` sharing strategy sends a shared-memory file *name*; the receiver opens whatever file it names,
grows it to the size the payload says and runs torch's refcount protocol on it (its first int32 decremented, the
file unlinked at 0: `torch/multiprocessing/reductions.py`, `rebuild_storage_filename` and `StorageWeakRef`). A
payload could name any file under /dev/shm. Here the sender makes every segment itself, and the receiver only reads
what it can tell is a segment made for the update it holds:

- the sender creates `/dev/shm/trueflow-<run>-<random>` exclusively, mode 0600, sized to a 64-byte header plus the
  data; before every update it writes into the header a magic, the data size and a fresh random nonce, which the
  payload carries beside the name and the size;
- the receiver opens only names of that pattern, read-only, and before it maps a byte checks that the file is a
  regular file of its own user, closed to every other, of exactly the header plus the declared size; then that the
  header holds the payload's nonce (a third party can list the names, not read the nonces). It maps the file
  copy-on-write, so the sender's bytes cannot change through it, and never writes, resizes or unlinks it;
- the sender unlinks its segments when it is done with them (`close`, and at exit); Python's resource tracker
  unlinks those of a process killed without a word; a run's driver unlinks whatever its processes left
  (`unlink_run`, by the run's tag, `TRUEFLOW_RUN_TAG`).
"""

from __future__ import annotations

import hmac
import mmap
import os
import re
import secrets
import stat
import struct
import weakref
from multiprocessing import resource_tracker
from pathlib import Path

import _posixshmem
import torch

HEADER = 64  # magic (16) | data bytes (u64 LE) | 8 zero bytes | nonce (32); the data starts 64-byte aligned
MAGIC = b"trueflow-shm/1\0\0"
NONCE_BYTES = 32
TAG_ENV = "TRUEFLOW_RUN_TAG"  # a run's processes name their segments with it; its driver unlinks them by it
_TAG = re.compile(r"[0-9A-Za-z]{1,32}")
NAME = re.compile(r"/trueflow-[0-9A-Za-z]{1,32}-[0-9a-f]{16}")
SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared memory


def run_tag() -> str:
    """This run's segment tag: the driver's `TRUEFLOW_RUN_TAG`, else this process's id."""
    tag = os.environ.get(TAG_ENV) or f"p{os.getpid()}"
    if not _TAG.fullmatch(tag):
        raise ValueError(f"{TAG_ENV}={tag!r}: a run tag is 1 to 32 letters and digits")
    return tag


def _header(size: int, nonce: bytes) -> bytes:
    return MAGIC + struct.pack("<Q", size) + bytes(8) + nonce


def _unlink(names: set[str], which: list[str] | None = None) -> None:
    """Unlink `which` (default: all) of the linked `names`, and take them off the resource tracker's list."""
    for name in list(names) if which is None else which:
        try:
            _posixshmem.shm_unlink(name)
        except FileNotFoundError:  # its run's driver got there first
            pass
        resource_tracker.unregister(name, "shared_memory")
        names.discard(name)


class _Segment:
    def __init__(self, name: str, size: int, mm: mmap.mmap):
        # The map lives as long as any tensor over it (torch.frombuffer holds it): a dead reference means the
        # segment's buffers are all gone.
        self.name, self.size, self.mm = name, size, weakref.ref(mm)


class SharedSegments:
    """The sender's side: CPU bucket buffers in segments of its own. `allocate` makes a buffer in a new segment (a
    `sync.buckets.pack` allocator); `describe` gives what a payload declares for such a buffer. A segment whose
    buffer is gone is unlinked at the next call; `close` unlinks them all, and so does the interpreter's exit."""

    def __init__(self) -> None:
        self._segments: dict[int, _Segment] = {}  # the buffer's data pointer -> its segment
        self._names: set[str] = set()  # linked names, shared with the exit-time finalizer
        self._finalizer = weakref.finalize(self, _unlink, self._names)

    def allocate(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """A uint8 buffer of `nbytes`: in a new segment on the CPU, plain device memory elsewhere (it crosses as a
        CUDA IPC handle)."""
        if torch.device(device).type != "cpu" or nbytes == 0:  # an empty buffer crosses as its size alone
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._prune()
        name = f"/trueflow-{run_tag()}-{secrets.token_hex(8)}"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        self._names.add(name)
        resource_tracker.register(name, "shared_memory")  # unlinked by the tracker if this process dies unannounced
        try:
            os.ftruncate(fd, HEADER + nbytes)
            mm = mmap.mmap(fd, HEADER + nbytes)
        finally:
            os.close(fd)
        mm[:HEADER] = _header(nbytes, bytes(NONCE_BYTES))
        tensor = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=HEADER)
        self._segments[tensor.data_ptr()] = _Segment(name, nbytes, mm)
        return tensor

    def describe(self, buffer: torch.Tensor) -> dict:
        """{"shm": name, "size": bytes, "nonce": a fresh nonce, now also in the segment's header} of a CPU uint8
        buffer; the receiver maps that segment while the sender keeps `buffer` unchanged, until it has answered."""
        if buffer.numel() == 0:
            return {"shm": None, "size": 0, "nonce": None}
        self._prune()
        seg = self._segments.get(buffer.data_ptr())
        if seg is None or seg.size != buffer.numel() or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
            raise ValueError("a CPU bucket crosses by shared memory only from a segment of its sender: pack it with "
                             "`pack(..., allocate=segments.allocate)` (or a BucketPacker given that allocator)")
        nonce = secrets.token_bytes(NONCE_BYTES)
        mm = seg.mm()
        assert mm is not None  # alive: `buffer` is over it
        mm[:HEADER] = _header(seg.size, nonce)
        return {"shm": seg.name, "size": seg.size, "nonce": nonce}

    def _prune(self) -> None:
        gone = [key for key, seg in self._segments.items() if seg.mm() is None]
        _unlink(self._names, [self._segments.pop(key).name for key in gone])

    def close(self) -> None:
        """Unlink every segment (their memory goes when the last buffer over it does)."""
        self._segments.clear()
        _unlink(self._names)


def open_segment(name: str, size: int, nonce: bytes) -> torch.Tensor:
    """The `size` data bytes of the sender's segment `name`, mapped copy-on-write, once the checks of the module's
    docstring hold; ValueError naming the problem otherwise (nothing of the file is read before its owner, mode and
    size are checked; nothing is ever written to it)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"malformed IPC payload: {name!r:.80} is not the name of a trueflow shared-memory segment "
                         f"(/trueflow-<run>-<16 hex digits>)")
    not_ours = f"the shared-memory segment {name} is not one this update's sender made for it"
    try:
        fd = _posixshmem.shm_open(name, os.O_RDONLY, mode=0)
    except FileNotFoundError:
        raise ValueError(f"no shared-memory segment {name}: segments only open on the sender's machine while the "
                         f"sender keeps its buffers") from None
    except OSError as e:
        raise ValueError(f"{not_ours} ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        problems = [what for what, bad in [
            ("not a regular file", not stat.S_ISREG(st.st_mode)),
            ("another user's", st.st_uid != os.geteuid()),
            ("open to other users", st.st_mode & 0o077),
            (f"{st.st_size} bytes, not the {HEADER + size} its payload declares", st.st_size != HEADER + size)] if bad]
        if problems:
            raise ValueError(f"{not_ours}: {', '.join(problems)}")
        mm = mmap.mmap(fd, HEADER + size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if not hmac.compare_digest(mm[:HEADER], _header(size, nonce)):
        mm.close()
        raise ValueError(f"{not_ours}: its header holds another update's nonce")
    return torch.frombuffer(mm, dtype=torch.uint8, count=size, offset=HEADER) if size else \
        torch.empty(0, dtype=torch.uint8)


def unlink_run(tag: str) -> list[str]:
    """Unlink every segment of the run `tag` (its driver's cleanup after the run's processes are gone); returns
    their names."""
    if not _TAG.fullmatch(tag) or not SHM_DIR.is_dir():
        return []
    gone = []
    for path in SHM_DIR.glob(f"trueflow-{tag}-*"):
        if NAME.fullmatch(f"/{path.name}"):
            try:
                path.unlink()
                gone.append(f"/{path.name}")
            except FileNotFoundError:
                pass
    return gone
