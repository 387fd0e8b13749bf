"""Wire formats of the engine server (docs/server.md): rollouts as msgpack, weight buckets as IPC handles.

A tensor crosses as `{"dtype": "bfloat16", "shape": [...], "data": raw bytes}` (little-endian, C order), so every
bit arrives as the engine wrote it: a decoded rollout is `torch.equal` to the engine's, tensor by tensor.

Weight buckets (`sync.buckets`) cross as handles, never as their data, in a msgpack payload (no pickle: nothing in
it is code): a CPU bucket as the name, size and nonce of a shared-memory segment its sender made for it
(`sync.shm`), a CUDA bucket as the fields of torch's CUDA IPC handle. The receiver checks the whole payload (every
manifest entry inside its bucket, every name and field of the right form) before it opens anything, then opens
only what the checks of `sync.shm` (segments) and `_cuda_buffer` (CUDA IPC) let through.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

import msgpack
import torch

from ..sync.buckets import Bucket
from ..sync.shm import NONCE_BYTES, SharedSegments, open_segment
from .sampling_params import SamplingParams
from .trajectory import Microgroup, Rollout, StepRecord

# /2: a microgroup's `grid` and named conditioning (`cond`, `negative_cond`); /3: the expert of each step (`experts`)
FORMAT = "trueflow-rollout/3"
IPC_CONTENT_TYPE = "application/x-trueflow-ipc-handles"
_TENSOR_KEYS = {"dtype", "shape", "data"}
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


# -- tensors and rollouts (msgpack) ----------------------------------------------------------------------------
def encode_tensor(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}


def decode_tensor(d: dict) -> torch.Tensor:
    dtype, shape = _DTYPES[d["dtype"]], d["shape"]
    if not d["data"]:  # frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8).view(dtype).reshape(shape)


def _encode(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return encode_tensor(v)
    if is_dataclass(v):
        return {f.name: _encode(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, dict):
        return decode_tensor(v) if v.keys() == _TENSOR_KEYS else {k: _decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def encode_rollout(rollout: Rollout) -> bytes:
    """Every field of the rollout and of each microgroup (step records included), tensors as raw bytes."""
    return msgpack.packb({
        "format": FORMAT, "prompts": rollout.prompts, "n_per_prompt": rollout.n_per_prompt,
        "params": asdict(rollout.params), "seed": rollout.seed, "engine": rollout.engine,
        "microgroups": [_encode(mg) for mg in rollout.microgroups],
        "images": None if rollout.images is None else encode_tensor(rollout.images),
        "first_prompt": rollout.first_prompt, "rewards": _encode(rollout.rewards), "dropped": rollout.dropped,
        "times": rollout.times})


def decode_rollout(data: bytes) -> Rollout:
    """The client side of `encode_rollout`: the same Rollout, bit for bit, on the CPU."""
    msg = msgpack.unpackb(data)
    if msg.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} payload (format {msg.get('format')!r})")
    microgroups = []
    for d in msg["microgroups"]:
        d = _decode(d)
        d["grid"] = tuple(d["grid"])
        if d["records"] is not None:
            d["records"] = [StepRecord(**r) for r in d["records"]]
        microgroups.append(Microgroup(**d))
    return Rollout(msg["prompts"], msg["n_per_prompt"], SamplingParams(**msg["params"]), msg["seed"], microgroups,
                   None if msg["images"] is None else decode_tensor(msg["images"]), msg["engine"],
                   msg["first_prompt"], _decode(msg["rewards"]), msg["dropped"], msg["times"])


# -- weight buckets (IPC handles) --------------------------------------------------------------------------------
IPC_FORMAT = "trueflow-ipc/1"
MAX_BUCKET_BYTES = 1 << 40  # far above any bucket; a bound on what a payload may declare
# torch's CUDA IPC refcount file (`torch/csrc/CudaIPCTypes.h`: CUDA_IPC_REF_COUNTER_FILE_SIZE int64 counters after
# RefcountedMapAllocator's 64-byte header), named by `at::NewProcessWideShmHandle`: /torch_<pid>_<random>_<n>.
CUDA_REF_COUNTERS = 10000
CUDA_REF_FILE_BYTES = 64 + 8 * CUDA_REF_COUNTERS
_CUDA_REF_NAME = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")


def dump_handles(buckets: list[Bucket], segments: SharedSegments, **fields: Any) -> bytes:
    """The payload `{"format", "buckets": [declared handle + manifest], "fields"}` of `buckets`, whose CPU buffers
    must lie in `segments` (`pack(..., allocate=segments.allocate)`). The sender keeps the buckets, unchanged, until
    the receiver has answered."""
    out = []
    for b in buckets:
        manifest = [[n, str(dtype).removeprefix("torch."), list(shape), off] for n, dtype, shape, off in b.manifest]
        handle = _cuda_handle(b.buffer) if b.buffer.is_cuda else segments.describe(b.buffer)
        out.append({"manifest": manifest, "size": b.buffer.numel(), **handle})
    return msgpack.packb({"format": IPC_FORMAT, "buckets": out, "fields": fields})


def _cuda_handle(buffer: torch.Tensor) -> dict:
    """torch's own reduction of a CUDA tensor (`reductions.reduce_tensor`: `_share_cuda_`, its refcount entry and
    event), as plain fields."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, a = reduce_tensor(buffer)
    return {"cuda": {"device": a[6], "handle": a[7], "storage_bytes": a[8], "storage_offset": a[9],
                     "tensor_offset": a[3], "ref_counter": a[11], "ref_counter_offset": a[12], "event": a[13],
                     "event_sync_required": a[14]}}


@dataclass
class Declared:
    """One bucket as its payload declares it, checked but not opened."""

    size: int
    manifest: list[tuple[str, torch.dtype, tuple[int, ...], int]]
    shm: tuple[str, bytes] | None = None  # (segment name, nonce)
    cuda: dict | None = None


@dataclass
class Handles:
    """A checked IPC payload: its buckets, not yet opened, and its other fields."""

    buckets: list[Declared]
    fields: dict[str, Any]

    @property
    def cuda(self) -> bool:
        return any(b.cuda is not None for b in self.buckets)


def _malformed(why: str) -> ValueError:
    return ValueError(f"malformed IPC payload: {why}")


def _is_int(v: Any, lo: int = 0, hi: int = 2**63 - 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def parse_handles(data: bytes) -> Handles:
    """The payload checked whole, nothing opened: its form, every bucket's declared handle, and every manifest
    entry lying aligned within its bucket. ValueError naming the first problem."""
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - garbage, a pickle, truncated data
        raise _malformed(f"not a {IPC_FORMAT} payload ({type(e).__name__})") from None
    fmt = msg.get("format") if isinstance(msg, dict) else None
    if fmt != IPC_FORMAT:
        raise _malformed(f"not a {IPC_FORMAT} payload (format {fmt!r:.40})")
    if set(msg) != {"format", "buckets", "fields"} or not isinstance(msg["buckets"], list) \
            or not isinstance(msg["fields"], dict):
        raise _malformed("expected a map of format, buckets (a list) and fields (a map)")
    buckets = [_declared(i, b) for i, b in enumerate(msg["buckets"])]
    names = [b.shm[0] for b in buckets if b.shm is not None]
    if len(set(names)) != len(names):
        raise _malformed("two buckets name the same shared-memory segment")
    return Handles(buckets, msg["fields"])


def _declared(i: int, b: Any) -> Declared:
    where = f"bucket {i}"
    if not isinstance(b, dict) or not ({"manifest", "size"} <= set(b)):
        raise _malformed(f"{where} must be a map with a manifest, a size and a handle")
    size, kind = b["size"], set(b) - {"manifest", "size"}
    if not _is_int(size, 0, MAX_BUCKET_BYTES):
        raise _malformed(f"{where}: size {size!r:.40} is not a byte count in 0..{MAX_BUCKET_BYTES}")
    manifest = _manifest(where, b["manifest"], size)
    if kind == {"shm", "nonce"}:
        name, nonce = b["shm"], b["nonce"]
        if size == 0 and name is None and nonce is None:
            return Declared(0, manifest)
        if not (isinstance(name, str) and isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES):
            raise _malformed(f"{where}: a shared-memory handle is a segment name and a {NONCE_BYTES}-byte nonce")
        return Declared(size, manifest, shm=(name, nonce))
    if kind == {"cuda"}:
        return Declared(size, manifest, cuda=_cuda_fields(where, b["cuda"], size))
    raise _malformed(f"{where}: its handle must be a shared-memory segment (shm, nonce) or a CUDA IPC handle (cuda)")


def _manifest(where: str, manifest: Any, size: int) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    if not isinstance(manifest, list):
        raise _malformed(f"{where}: the manifest must be a list of [name, dtype, shape, byte offset]")
    out = []
    for entry in manifest:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and entry[1] in _DTYPES and isinstance(entry[2], list) and len(entry[2]) <= 16
                and all(_is_int(s, 0, MAX_BUCKET_BYTES) for s in entry[2]) and _is_int(entry[3], 0, MAX_BUCKET_BYTES)):
            raise _malformed(f"{where}: a manifest entry must be [name, dtype, shape, byte offset], got {entry!r:.200}")
        name, dtype, shape, off = entry[0], _DTYPES[entry[1]], tuple(entry[2]), entry[3]
        nbytes = math.prod(shape) * dtype.itemsize
        if off % dtype.itemsize or off + nbytes > size:
            raise _malformed(f"{name} ({nbytes} bytes at offset {off}) does not lie aligned within its {size}-byte "
                             f"bucket")
        out.append((name, dtype, shape, off))
    return out


def _cuda_fields(where: str, c: Any, size: int) -> dict:
    keys = {"device", "handle", "storage_bytes", "storage_offset", "tensor_offset", "ref_counter",
            "ref_counter_offset", "event", "event_sync_required"}
    bad = _malformed(f"{where}: a CUDA IPC handle has the fields {', '.join(sorted(keys))} of torch's CUDA "
                     f"reduction")
    if not isinstance(c, dict) or set(c) != keys:
        raise bad
    ref = c["ref_counter"].decode("ascii", "replace") if isinstance(c["ref_counter"], bytes) else None
    if not (_is_int(c["device"], 0, 1023) and isinstance(c["handle"], bytes) and 0 < len(c["handle"]) <= 1024
            and _is_int(c["storage_bytes"], 0, MAX_BUCKET_BYTES) and _is_int(c["storage_offset"], 0, MAX_BUCKET_BYTES)
            and _is_int(c["tensor_offset"], 0, MAX_BUCKET_BYTES) and c["tensor_offset"] + size <= c["storage_bytes"]
            and ref is not None and _CUDA_REF_NAME.fullmatch(ref)
            and _is_int(c["ref_counter_offset"], 0, CUDA_REF_COUNTERS - 1)
            and (c["event"] is None or isinstance(c["event"], bytes) and len(c["event"]) <= 1024)
            and isinstance(c["event_sync_required"], bool)):
        raise bad
    return c


def open_handles(handles: Handles) -> list[Bucket]:
    """The declared buckets, opened: views of the sender's memory (no copy), each checked before it is mapped
    (`sync.shm.open_segment`, `_cuda_buffer`)."""
    out = []
    for b in handles.buckets:
        if b.shm is not None:
            buffer = open_segment(b.shm[0], b.size, b.shm[1])
        elif b.cuda is not None:
            buffer = _cuda_buffer(b.cuda, b.size)
        else:
            buffer = torch.empty(0, dtype=torch.uint8)
        out.append(Bucket(buffer, b.manifest))
    return out


def _cuda_buffer(c: dict, size: int) -> torch.Tensor:
    """The sender's CUDA buffer, rebuilt as torch's unpickler would (`reductions.rebuild_cuda_tensor`), once the
    refcount file it names is one torch made for CUDA IPC: of torch's name pattern (checked already), this user's,
    closed to others and of the counters' exact size, so that torch's counter update (+1 now, -1 when the buffer
    is freed) can neither grow nor touch any other file."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ref = c["ref_counter"].decode("ascii")
    not_ours = f"the CUDA IPC refcount file {ref} is not one torch made for this update's sender"
    try:
        st = os.stat(f"/dev/shm{ref}", follow_symlinks=False)
    except OSError:
        raise ValueError(f"{not_ours} (there is no such file: CUDA IPC handles only open on the sender's machine while "
                         f"the sender keeps its buffers)") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 \
            or st.st_size != CUDA_REF_FILE_BYTES:
        raise ValueError(f"{not_ours} (owner, mode or size)")
    try:
        return rebuild_cuda_tensor(torch.Tensor, torch.Size([size]), (1,), c["tensor_offset"],
                                   torch.storage.TypedStorage, torch.uint8, c["device"], c["handle"],
                                   c["storage_bytes"], c["storage_offset"], False, c["ref_counter"],
                                   c["ref_counter_offset"], c["event"], c["event_sync_required"])
    except Exception as e:  # noqa: BLE001 - most likely a handle this process cannot open
        raise ValueError(f"cannot open the CUDA IPC handle ({type(e).__name__}: {e}); handles only open on the "
                         f"sender's machine while the sender keeps its buffers") from None


def load_handles(data: bytes) -> tuple[list[Bucket], dict[str, Any]]:
    """The receiver side of `dump_handles`: the payload checked (`parse_handles`), then its buckets opened (views of
    the sender's memory, no copy), and its other fields. ValueError naming the problem."""
    handles = parse_handles(data)
    return open_handles(handles), handles.fields
