"""Wire formats of the engine server (docs/server.md): rollouts as msgpack, weight buckets as IPC handles.

A tensor crosses as `{"dtype": "bfloat16", "shape": [...], "data": raw bytes}` (little-endian, C order), so every
bit arrives as the engine wrote it: a decoded rollout is `torch.equal` to the engine's, tensor by tensor.

Weight buckets (`sync.buckets`) cross as IPC handles: torch's multiprocessing pickler reduces each bucket's
buffer to a handle (on CPU a shared-memory file name under the `file_system` sharing strategy, on GPU a CUDA IPC
handle), never to its data. Unpickling runs code, so the server unpickles with an allow-list of torch's
rebuild functions only, and accepts such payloads from loopback clients only.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
from collections.abc import Iterator
from dataclasses import asdict, fields, is_dataclass
from typing import Any

from multiprocessing.reduction import ForkingPickler

import msgpack
import torch
import torch.multiprocessing as mp  # importing it registers torch's reductions with ForkingPickler

from ..sync.buckets import Bucket
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
@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    # CPU storages reduce to a shared-memory file *name* only under this strategy; the default one sends a file
    # descriptor, which means nothing to a process reached over HTTP. Restored after: the strategy is global.
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(old)


def dump_handles(buckets: list[Bucket], **fields: Any) -> bytes:
    """A pickled payload `{"buckets": [(buffer, manifest)], **fields}` whose buffers cross as IPC handles. The
    sender must keep `buckets` alive until the receiver has answered."""
    with _file_system_sharing():
        return bytes(ForkingPickler.dumps({"buckets": [(b.buffer, b.manifest) for b in buckets], **fields}))


_ALLOWED_GLOBALS = {("torch.multiprocessing.reductions", n) for n in (
    "rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_storage_empty",
    "rebuild_cuda_tensor")} | {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"),
                               ("torch.storage", "TypedStorage")}


class _HandleUnpickler(pickle.Unpickler):
    """Resolves only torch's tensor/storage rebuild functions, tensor classes and dtypes: a payload naming any
    other global (the way pickles run arbitrary code) is refused before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in an IPC payload")


def load_handles(data: bytes) -> tuple[list[Bucket], dict[str, Any]]:
    """The receiver side of `dump_handles`: buckets mapped from the sender's memory (no copy), and the other fields.
    Raises ValueError for anything malformed, naming the problem."""
    try:
        payload = _HandleUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:  # garbage, or a refused global
        raise ValueError(f"malformed IPC payload ({e})") from e
    except Exception as e:  # noqa: BLE001 - most likely a handle this process cannot open
        raise ValueError(f"cannot open the IPC payload ({type(e).__name__}: {e}); handles only open on the sender's "
                         f"machine while the sender keeps its buffers alive") from e
    if not isinstance(payload, dict) or not isinstance(payload.get("buckets"), list):
        raise ValueError("malformed IPC payload: expected a map with a 'buckets' list")
    return [_bucket(item) for item in payload.pop("buckets")], payload


def _bucket(item: Any) -> Bucket:
    bad = "malformed IPC payload: a bucket must be (uint8 buffer, [(name, dtype, shape, byte offset)])"
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], list)):
        raise ValueError(bad)
    buffer, manifest = item
    if not (isinstance(buffer, torch.Tensor) and buffer.dtype == torch.uint8 and buffer.dim() == 1):
        raise ValueError(bad)
    for entry in manifest:
        if not (isinstance(entry, tuple) and len(entry) == 4 and isinstance(entry[0], str)
                and isinstance(entry[1], torch.dtype) and isinstance(entry[2], tuple)
                and all(isinstance(s, int) and s >= 0 for s in entry[2]) and isinstance(entry[3], int)):
            raise ValueError(f"{bad}; got the entry {entry!r:.200}")
        name, dtype, shape, off = entry
        nbytes = math.prod(shape) * dtype.itemsize
        if off < 0 or off % dtype.itemsize or off + nbytes > buffer.numel():
            raise ValueError(f"malformed IPC payload: {name} ({nbytes} bytes at offset {off}) does not lie aligned "
                             f"within its {buffer.numel()}-byte bucket")
    return Bucket(buffer, manifest)
