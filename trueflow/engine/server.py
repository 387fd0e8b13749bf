"""The engine server (`trueflow serve`): one rollout Engine behind FastAPI, and its clients (docs/server.md).

Every engine call (a rollout, a weight update, a checksum) runs on one worker thread, in arrival order: the engine
is not thread-safe, and an update queued behind a rollout lands after that rollout's last step, never inside it.
Requests are not merged across clients. A microgroup is one batch through the denoise loop; running two requests'
microgroups as one larger batch changes the GEMMs' batch size, which changes bf16 bits on GPU (batch 4 vs 4 x
batch 1 differed by 7.8e-3 on an H200), and concatenating their prompts into one rollout renumbers the prompts,
which changes their noise streams. So each request runs alone, exactly as `Engine.rollout` with its arguments: its
result is bitwise the same however busy the server is. Parsing, encoding and weight validation run off the worker.

Every request's work is bounded before it reaches the worker (`Limits`), and a running rollout stops at its next
denoising step when its client leaves, its time is up, or the server shuts down.

The app holds its engine through the engine interface (`interface.RolloutEngine`, whose `rollout` also takes
`should_stop`): an in-process `Engine`, or with `--tp N` a tensor-parallel `sync.engine_process.EngineClient` over N
processes (docs/tensor-parallel.md), which the server ends before it exits.
"""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import json
import logging
import math
import pickletools
import queue
import re
import threading
import time
import types
import typing
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

import httpx
import msgpack
import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from safetensors.torch import load_file
from starlette.exceptions import HTTPException

from ..http import MSGPACK
from ..loading import read_transformer_state_dict, transformer_dir
from ..models import get_family
from ..sync.buckets import DEFAULT_BUCKET_BYTES, pack, unpack
from . import wire
from .engine import Engine, RolloutCancelled, SamplingParams
from .interface import RolloutEngine, RolloutRequest
from .sampling_params import TOKENIZER_MAX_LENGTH, check_family_limits
from .trajectory import Rollout

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)
log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server refuses: answered with `status` and the error body of its route (docs/server.md,
    "Errors"); `param` names the request field at fault, `code` is a short machine-readable reason. The server
    keeps serving."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


# -- limits ----------------------------------------------------------------------------------------------------
PROMPT_CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per allowed token is refused untokenized
WEIGHT_JSON_BYTES = 64 << 10  # a path update's JSON body
IPC_PAYLOAD_BYTES = 64 << 20  # a pickled bucket list: handles and manifests, never tensor data


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, each a `trueflow serve` flag (docs/server.md, "Limits").

    The defaults fit Qwen-Image: its pipeline's largest sizes are about 1.8 megapixels (1328x1328) and its text
    window is `TOKENIZER_MAX_LENGTH` tokens (longer prompts would be cut), it makes images (one frame), and a
    request may ask for one GRPO group of samples."""

    max_steps: int = 100  # denoising steps per sample (the pipeline's default is 50)
    max_pixels: int = 2048 * 2048  # height x width of one frame
    max_frames: int = 1  # frames per sample; image families make one
    max_prompt_tokens: int = TOKENIZER_MAX_LENGTH  # tokens of each prompt and of the negative prompt
    max_samples: int = 64  # prompts x n_per_prompt of one request
    max_queue: int = 16  # engine calls a generation request may find waiting (weight updates always queue)
    request_timeout: float = 3600.0  # seconds from a generation request's arrival to its answer (`remote_rollout`'s)

    def __post_init__(self) -> None:
        for f in fields(self):
            v, least = getattr(self, f.name), 0 if f.name == "max_queue" else 1
            if f.name == "request_timeout" and not (math.isfinite(v) and v > 0):
                raise ValueError(f"--request-timeout must be a positive number of seconds, got {v}")
            if f.name != "request_timeout" and not (isinstance(v, int) and v >= least):
                raise ValueError(f"--{f.name.replace('_', '-')} must be an integer >= {least}, got {v}")
        if self.max_prompt_tokens > TOKENIZER_MAX_LENGTH:
            raise ValueError(f"--max-prompt-tokens must be at most {TOKENIZER_MAX_LENGTH} (the text encoder's window: "
                             f"the pipeline cuts longer prompts), got {self.max_prompt_tokens}")

    @property
    def max_prompt_chars(self) -> int:
        return self.max_prompt_tokens * PROMPT_CHARS_PER_TOKEN

    @property
    def generation_body_bytes(self) -> int:
        """The largest generation body that can hold a valid request: every prompt and the negative prompt at
        the character bound, at 12 bytes a character (a JSON surrogate pair), plus room for the other fields."""
        return (self.max_samples + 1) * self.max_prompt_chars * 12 + (64 << 10)

    def check(self, samples: int, params: SamplingParams, prompts: list[str]) -> None:
        """Refuse a request past a bound, naming the field and the flag (tokens are counted later, off the loop)."""
        for value, bound, what, param, flag in [
                (samples, self.max_samples, "samples (prompts x n)", "n_per_prompt", "--max-samples"),
                (params.steps, self.max_steps, "denoising steps", "steps", "--max-steps"),
                (params.height * params.width, self.max_pixels,
                 f"pixels per frame ({params.width}x{params.height})", "width", "--max-pixels"),
                (params.num_frames, self.max_frames, "frames", "num_frames", "--max-frames")]:
            if value > bound:
                raise RequestError(f"the request asks for {value} {what}; this server takes at most {bound} "
                                   f"({flag})", param=param, code="limit_exceeded")
        for name, text in [*(("prompts", p) for p in prompts), ("negative_prompt", params.negative_prompt)]:
            if len(text) > self.max_prompt_chars:
                raise RequestError(f"a prompt of {len(text)} characters is too long: this server takes prompts of "
                                   f"at most {self.max_prompt_tokens} tokens (--max-prompt-tokens) and refuses any "
                                   f"longer than {self.max_prompt_chars} characters before tokenizing",
                                   param=name, code="limit_exceeded")


class _TokenCounter:
    """Tokens of prompts, by a tokenizer of the server's own (the engine's is its thread's, or another process's):
    the class the checkpoint's tokenizer config names, as the family's text loader reads it."""

    def __init__(self, checkpoint: str):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(Path(checkpoint) / "tokenizer")
        self._lock = threading.Lock()

    def check(self, limits: Limits, prompts: list[str], negative_prompt: str) -> None:
        with self._lock:
            counts = [len(ids) for ids in self._tokenizer([*prompts, negative_prompt],
                                                           add_special_tokens=False)["input_ids"]]
        for i, n in enumerate(counts):
            if n > limits.max_prompt_tokens:
                raise RequestError(f"{'the negative prompt' if i == len(prompts) else f'prompt {i}'} is {n} tokens; "
                                   f"this server takes at most {limits.max_prompt_tokens} (--max-prompt-tokens)",
                                   param="negative_prompt" if i == len(prompts) else "prompts", code="limit_exceeded")


# -- the worker ------------------------------------------------------------------------------------------------
STUCK_GRACE_S = 30.0  # past its timeout, a running call has this long (or its timeout, if shorter) to stop
_POLL_S = 0.2  # how often a waiting request looks for its client's disconnect


class _Job(Generic[_T]):
    """One engine call: `fn(should_stop)`, its deadline, and why it was stopped (None: it was not)."""

    def __init__(self, fn: Callable[[Callable[[], bool]], _T], deadline: float | None):
        self.fn, self.deadline = fn, deadline
        self.future: Future[_T] = Future()
        self.started: float | None = None
        self.stop_reason: str | None = None

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def should_stop(self) -> bool:
        if self.stop_reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.stop_reason = "timeout"
        return self.stop_reason is not None


class Worker:
    """Runs engine calls one at a time, in arrival order, on one daemon thread: a call stuck in the engine
    cannot keep the process from exiting."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.jobs: list[_Job] = []  # waiting or running, in arrival order
        self.running: _Job | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="engine")
        self.thread.start()

    @property
    def depth(self) -> int:
        """Engine calls waiting or running."""
        return len(self.jobs)

    def submit(self, fn: Callable[[Callable[[], bool]], _T], deadline: float | None = None,
               max_waiting: int | None = None) -> _Job[_T]:
        """Queue `fn`; with `max_waiting`, refuse it (503) when that many calls already wait."""
        with self._lock:
            if self.closed:
                raise RequestError("the server is shutting down", 503, code="shutting_down")
            waiting = sum(j.started is None for j in self.jobs)
            if max_waiting is not None and waiting >= max_waiting:
                raise RequestError(f"the server is busy: {waiting} requests already wait for the engine, the most it "
                                   f"queues (--max-queue); retry later", 503, code="queue_full")
            job = _Job(fn, deadline)
            self.jobs.append(job)
        self._queue.put(job)
        return job

    def close(self) -> None:
        """Take no more work and stop every queued or running call at its next step. Takes no lock: it runs in
        a signal handler, which may interrupt `submit` on the same thread."""
        self.closed = True
        for job in list(self.jobs):
            job.stop("shutdown")

    def join(self) -> None:
        """End the thread once the queue is drained (after `close`)."""
        self._queue.put(None)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            result, error = None, None
            if job.should_stop():
                error = RolloutCancelled("stopped before it started")
            else:
                job.started = time.monotonic()
                self.running = job
                try:
                    result = job.fn(job.should_stop)
                except BaseException as e:  # noqa: BLE001 - handed to the request that waits for it
                    error = e
                self.running = None
            with self._lock:  # off the list before the answer: a client that got its answer sees the call gone
                self.jobs.remove(job)
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)

    async def wait(self, job: _Job[_T], request: Request | None, timeout: float | None = None) -> _T:
        """The call's result; stops it when `request`'s client disconnects (or this waiting task is cancelled)."""
        future = asyncio.wrap_future(job.future)
        try:
            while not future.done():
                await asyncio.wait({future}, timeout=_POLL_S)
                if not future.done() and request is not None and await request.is_disconnected():
                    job.stop("disconnected")
        except asyncio.CancelledError:  # uvicorn gave up waiting for this request at shutdown
            job.stop("shutdown")
            raise
        try:
            return future.result()
        except RolloutCancelled as e:
            raise _stopped(job, timeout) from e
        except ValueError as e:  # the engine's contract: a ValueError is the caller's bad input, nothing applied
            raise RequestError(str(e)) from e


def _stopped(job: _Job, timeout: float | None) -> RequestError:
    when = "while it ran" if job.started is not None else "before it started"
    if job.stop_reason == "timeout":
        return RequestError(f"the request ran past this server's per-request timeout of {timeout:g} s "
                            f"(--request-timeout) and was stopped {when}", 504, code="timeout")
    if job.stop_reason == "disconnected":  # nobody reads this answer
        return RequestError(f"the client disconnected; the request was stopped {when}", 499, code="cancelled")
    return RequestError(f"the server is shutting down; the request was stopped {when}", 503, code="shutting_down")


# -- requests --------------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    """No coercion: a string is no list or number, a number no string, a bool no int, a float no int; floats
    may be sent as ints and must be finite; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


_D = SamplingParams()


class _Sampling(_Strict):
    """Every `SamplingParams` field, with its default (a test keeps the two in step). The engine checks values."""

    steps: int = _D.steps
    sampler: str = _D.sampler
    noise_level: float = _D.noise_level
    cfg_scale: float = _D.cfg_scale
    cfg_scale_2: float | None = _D.cfg_scale_2
    distilled_guidance_scale: float | None = _D.distilled_guidance_scale
    negative_prompt: str = _D.negative_prompt
    num_sde_steps: int | None = _D.num_sde_steps
    sde_window: tuple[StrictInt, StrictInt] | None = Field(_D.sde_window, strict=False)  # msgpack sends a list
    height: int = _D.height
    width: int = _D.width
    num_frames: int = _D.num_frames
    fps: float = _D.fps
    max_sequence_length: int = _D.max_sequence_length
    rollout_microgroup_size: int | None = _D.rollout_microgroup_size

    def params(self) -> SamplingParams:
        try:
            return SamplingParams(**{f: getattr(self, f) for f in _Sampling.model_fields})
        except ValueError as e:
            raise RequestError(str(e)) from e


class RolloutBody(_Sampling):
    """`POST /rollout/generate`: an `interface.RolloutRequest`, sampling params flat."""

    prompts: list[str]
    n_per_prompt: int
    seed: int
    first_prompt: int = 0
    decode: bool = True
    record_snapshot: bool = False

    def request(self) -> RolloutRequest:
        try:
            return RolloutRequest(self.prompts, self.n_per_prompt, self.params(), self.seed, self.first_prompt,
                                  self.decode, self.record_snapshot)
        except ValueError as e:
            raise RequestError(str(e), param="first_prompt") from e


class ImagesRequest(_Strict):
    """`POST /v1/images/generations`: OpenAI's fields this server honours, and a few sampling extensions."""

    prompt: str
    n: int = 1
    size: str = f"{_D.width}x{_D.height}"
    response_format: str = "b64_json"
    model: str | None = None  # OpenAI clients send one; there is one model here
    seed: int | None = None
    steps: int = _D.steps
    cfg_scale: float = _D.cfg_scale
    sampler: str = _D.sampler
    negative_prompt: str = _D.negative_prompt


class LoraUpdate(_Strict):
    scale: float
    merge_mode: str | None = None


class LoraByPath(LoraUpdate):
    path: str


class FullUpdate(_Strict):
    pass


class FullByPath(FullUpdate):
    path: str


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(map(_type_name, args))
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(map(_type_name, args))}]"
    return {float: "a finite float", type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


def _validate(model: type[_M], body: Any) -> _M:
    """`body` as a `model`, or a RequestError naming the unknown, missing or mistyped fields."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a map of fields, got {type(body).__name__}")
    try:
        out = model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        for kind, what in (("invalid_key", "field names must be strings, got"), ("extra_forbidden", "unknown field(s)"),
                           ("missing", "missing field(s)")):
            names = [x["loc"][0] for x in errors if x["type"] == kind and len(x["loc"]) == 1]
            if names:
                takes = f"; this endpoint takes {', '.join(sorted(model.model_fields))}" * (kind == "extra_forbidden")
                raise RequestError(f"{what} {', '.join(map(repr, sorted(names, key=str)))}{takes}",
                                   param=str(names[0])) from None
        name = errors[0]["loc"][0]
        raise RequestError(f"field {name!r} must be {_type_name(model.model_fields[name].annotation)}, got "
                           f"{type(body.get(name)).__name__} {body.get(name)!r:.100}", param=name) from None
    seed = getattr(out, "seed", None)
    if seed is not None and not -2**63 <= seed < 2**63:  # seeds are hashed as signed 64-bit integers
        raise RequestError(f"field 'seed' must fit a signed 64-bit integer, got {seed}", param="seed")
    return out


def _body(data: bytes, fmt: str) -> Any:
    try:
        return msgpack.unpackb(data) if fmt == "msgpack" else json.loads(data)
    except Exception as e:  # noqa: BLE001 - any undecodable body is the client's error
        raise RequestError(f"malformed {fmt} body ({type(e).__name__}: {str(e):.200})") from e


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes before more of it is read."""
    too_big = RequestError(f"the body is larger than the {limit} bytes this endpoint takes", 413, code="too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


# -- weights ---------------------------------------------------------------------------------------------------
def _is_loopback(host: str | None) -> bool:
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


_INDEX = "diffusion_pytorch_model.safetensors.index.json"  # the sharded-checkpoint index `loading` reads


def _inside(root: Path, path: Path | str) -> Path | None:
    """`path` (relative to `root`, or absolute) with `..` and links resolved, if it lies inside `root`."""
    try:
        real = (root / path).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a link loop
        return None
    return real if real.is_relative_to(root) else None


def _read_weights(root: Path | None, path: str, folders: bool) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (or, with `folders`, a checkpoint folder) under `root`. Refusals say
    nothing about anything outside `root` and never quote the file: its bytes may be anything."""
    if root is None:
        raise RequestError("weight loads by path are off on this server: start `trueflow serve` with "
                           "--weights-root DIR and send paths inside DIR, or send IPC handles", 403, param="path")
    outside = RequestError(f"the path {path!r} is not inside this server's --weights-root (relative paths are "
                           f"taken from it; '..' and links out of it are refused)", 403, param="path")
    real = _inside(root, path)
    if real is None:
        raise outside
    if not real.exists():
        raise RequestError(f"nothing at {path!r} under the weights root", param="path")
    try:
        if not (folders and real.is_dir()):
            return load_file(real)
        d = transformer_dir(real)
        files = [d / _INDEX] if (d / _INDEX).is_file() else sorted(d.glob("*.safetensors"))
        if any(_inside(root, f) is None for f in files):
            raise outside
        if files and files[0].name == _INDEX:  # the shards the index names must lie inside too
            shards = json.loads(files[0].read_text())["weight_map"].values()
            if any(_inside(root, d / s) is None for s in shards):
                raise outside
        return read_transformer_state_dict(d)
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file, a folder that is no checkpoint: logged, not echoed
        log.warning("weights at %s: %s: %s", real, type(e).__name__, e)
        raise RequestError(f"cannot read weights from {path!r}: not a readable safetensors file"
                           f"{' or checkpoint folder' if folders else ''} (the server's log has the details)",
                           param="path") from None


def _check_weights(state: dict[str, torch.Tensor]) -> None:
    """Refuse non-float and non-finite tensors before anything is applied (the engine checks names and shapes)."""
    problems = []
    for what, bad in (("not floating point", lambda t: not t.is_floating_point()),
                      ("NaN or inf values", lambda t: t.is_floating_point() and not torch.isfinite(t).all())):
        names = sorted(n for n, t in state.items() if bad(t))
        if names:
            problems.append(f"{what} in {len(names)} tensor(s): {', '.join(names[:20])}{' ...' * (len(names) > 20)}")
    if problems:
        raise RequestError("weights refused, nothing applied: " + "; ".join(problems))


def _names_cuda_tensors(payload: bytes) -> bool:
    """Whether an IPC payload rebuilds CUDA tensors: its pickle names torch's CUDA rebuild function (read from the
    opcodes; nothing is unpickled, so no handle is opened). A malformed payload says no: `load_handles` refuses it."""
    try:
        return any(isinstance(arg, str) and arg.rsplit(" ", 1)[-1] == "rebuild_cuda_tensor"
                   for _op, arg, _pos in pickletools.genops(payload))
    except Exception:  # noqa: BLE001 - not a pickle
        return False


async def _weights_request(request: Request, model: type[_M], by_path: type[_M], folders: bool,
                           root: Path | None, tp: int = 1) -> tuple[dict[str, torch.Tensor], _M]:
    """(tensors, other fields) of a weight update, from a safetensors path (JSON) or IPC handles, validated. A
    tensor-parallel engine (`tp` > 1) takes CPU handles only: it forwards the update to its ranks' processes from
    this one, which opens no GPU memory."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind == "application/json":
        body = _body(await _read_body(request, WEIGHT_JSON_BYTES), "JSON")
        fields_ = _validate(by_path, body)
        state = await asyncio.to_thread(_read_weights, root, fields_.path, folders)
    elif kind == wire.IPC_CONTENT_TYPE:
        if not _is_loopback(request.client.host if request.client else None):
            raise RequestError("IPC handles are taken from loopback clients only: the payload is a pickle, and "
                               "handles only open on the sender's machine", 403)
        payload = await _read_body(request, IPC_PAYLOAD_BYTES)
        if tp > 1 and _names_cuda_tensors(payload):
            raise RequestError(f"this server's engine is tensor-parallel (--tp {tp}, a process per rank), and it takes "
                               f"IPC weight updates from CPU tensors (shared memory) only: send the tensors moved to "
                               f"the CPU (push_lora(url, {{k: v.cpu() for k, v in state.items()}}, scale)), or a "
                               f"path under its --weights-root")
        try:
            buckets, rest = await asyncio.to_thread(wire.load_handles, payload)
        except ValueError as e:
            raise RequestError(str(e)) from e
        fields_, state = _validate(model, rest), unpack(buckets)
    else:
        raise RequestError(f"content-type must be application/json (a safetensors path) or {wire.IPC_CONTENT_TYPE} "
                           f"(IPC handles), got {kind or 'none'!r}", 415)
    await asyncio.to_thread(_check_weights, state)
    return state, fields_


def _png_b64(image: torch.Tensor) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image.numpy()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


# -- the app ---------------------------------------------------------------------------------------------------
_OPENAI_PARAM = {"n_per_prompt": "n", "width": "size", "height": "size", "prompts": "prompt"}


def _error_body(path: str, message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": message}`, or on the OpenAI routes (/v1/...) OpenAI's error object, which its SDKs show."""
    if not path.startswith("/v1/"):
        return {"error": message}
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": _OPENAI_PARAM.get(param, param), "code": code}}


def create_app(engine: RolloutEngine, limits: Limits = Limits(), default_seed: int = 0,
               weights_root: str | Path | None = None, threads: int | None = None) -> FastAPI:
    """The server of `engine`: an engine interface whose `rollout` takes `should_stop` (an `Engine`, or an
    `EngineClient`, whose health says `tp`). `limits`: what one request may ask; `default_seed`: the seed of
    OpenAI-style requests that name none; `weights_root`: the folder path-based weight updates may read (None:
    none); `threads`: the engine's intra-op CPU threads where another process runs it (None: read on the worker)."""
    root = None if weights_root is None else Path(weights_root).resolve()
    if root is not None and not root.is_dir():
        raise FileNotFoundError(f"--weights-root {weights_root}: no such folder")
    info = engine.health()  # what it runs, read once: an engine in other processes answers between calls only
    family, tp = get_family(info["family"]), info.get("tp", 1)
    worker = Worker()
    tokens = _TokenCounter(info["checkpoint"])
    if threads is None:
        threads = worker.submit(lambda _stop: torch.get_num_threads()).future.result()  # the engine thread's count

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        worker.close()
        worker.join()

    app = FastAPI(title="trueflow engine server", lifespan=lifespan)
    app.state.worker = worker

    async def refused(request: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(_error_body(request.url.path, str(e), e.status, e.param, e.code), e.status)

    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return JSONResponse(_error_body(request.url.path, e.detail, e.status_code), e.status_code)

    async def failed(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(_error_body(request.url.path, f"{type(e).__name__}: {e}", 500), 500)

    app.add_exception_handler(RequestError, refused)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, failed)

    async def generation(request: Request, samples: int, params: SamplingParams, prompts: list[str],
                         fn: Callable[[Callable[[], bool]], _T], arrived: float) -> _T:
        """Check the family's rules and `limits`, then run `fn` on the worker within the request's time, stopped if
        its client leaves."""
        try:
            check_family_limits(params, family)
        except ValueError as e:
            raise RequestError(str(e)) from e
        limits.check(samples, params, prompts)
        await asyncio.to_thread(tokens.check, limits, prompts, params.negative_prompt)
        job = worker.submit(fn, arrived + limits.request_timeout, limits.max_queue)
        return await worker.wait(job, request, limits.request_timeout)

    @app.get("/health")
    async def health() -> JSONResponse:
        running = worker.running
        age = None if running is None or running.started is None else time.monotonic() - running.started
        stuck = age is not None and age > limits.request_timeout + min(limits.request_timeout, STUCK_GRACE_S)
        # An engine in other processes fails every call once one of them has died (a rank's OOM, a kill).
        died = any(p.exitcode is not None for p in getattr(engine, "processes", ()))
        status = "shutting_down" if worker.closed else "failed" if died else "stuck" if stuck else "ok"
        return JSONResponse({
            **info, "status": status, "threads": threads,
            "busy": running is not None, "queue_depth": worker.depth,
            "running_for_s": None if age is None else round(age, 3), "limits": asdict(limits)},
            200 if status == "ok" else 503)

    @app.post("/rollout/generate")
    async def generate(request: Request) -> Response:
        arrived = time.monotonic()
        req = _validate(RolloutBody, _body(await _read_body(request, limits.generation_body_bytes),
                                           "msgpack")).request()

        def rollout(should_stop: Callable[[], bool]) -> Rollout:
            out = engine.rollout(req, should_stop=should_stop)
            out.engine["lora_checksum"] = engine.checksum()  # in the same call: the LoRA this rollout ran with
            return out

        out = await generation(request, len(req.prompts) * req.n_per_prompt, req.params, req.prompts, rollout,
                               arrived)
        return Response(await asyncio.to_thread(wire.encode_rollout, out), media_type=MSGPACK)

    @app.post("/v1/images/generations")
    async def images(request: Request) -> dict:
        arrived = time.monotonic()
        r = _validate(ImagesRequest, _body(await _read_body(request, limits.generation_body_bytes), "JSON"))
        if r.response_format != "b64_json":
            raise RequestError(f"response_format must be 'b64_json' (this server keeps no image URLs), "
                               f"got {r.response_format!r}", param="response_format")
        m = re.fullmatch(r"(\d{1,6})x(\d{1,6})", r.size)
        if not m:
            raise RequestError(f"size must be 'WIDTHxHEIGHT' in pixels, e.g. '64x64', got {r.size!r:.100}",
                               param="size")
        params = _Sampling(steps=r.steps, cfg_scale=r.cfg_scale, sampler=r.sampler, negative_prompt=r.negative_prompt,
                           width=int(m[1]), height=int(m[2])).params()
        seed = default_seed if r.seed is None else r.seed
        out = await generation(request, r.n, params, [r.prompt],
                               lambda stop: engine.rollout(RolloutRequest([r.prompt], r.n, params, seed),
                                                           should_stop=stop), arrived)
        data = await asyncio.to_thread(lambda: [{"b64_json": _png_b64(image)} for image in out.images])
        return {"created": int(time.time()), "seed": seed, "data": data}

    @app.post("/weights/lora")
    async def weights_lora(request: Request) -> dict:
        state, f = await _weights_request(request, LoraUpdate, LoraByPath, False, root, tp)

        def apply(_stop: Callable[[], bool]) -> str:
            return engine.update_weights(state, f.scale, f.merge_mode)

        return {"lora": await worker.wait(worker.submit(apply), request)}

    @app.post("/weights/full")
    async def weights_full(request: Request) -> dict:
        if tp > 1:  # refused before a byte of the weights is read
            raise RequestError(f"full-weight updates are not supported by a tensor-parallel engine (this server runs "
                               f"--tp {tp}): restart `trueflow serve` from a checkpoint holding the weights, or serve "
                               f"with --tp 1; LoRA updates (/weights/lora) are taken")
        state, _ = await _weights_request(request, FullUpdate, FullByPath, True, root)

        def apply(_stop: Callable[[], bool]) -> str:
            return engine.update_weights(state)

        return {"weights": await worker.wait(worker.submit(apply), request)}

    # A tensor-parallel engine holds no whole weights to hash: its `weights` is null.
    weights_checksum = getattr(engine, "weights_checksum", lambda: None)

    @app.get("/weights/checksum")
    async def checksum(request: Request) -> dict:
        job = worker.submit(lambda _stop: (weights_checksum(), engine.checksum()))
        weights, lora = await worker.wait(job, request)
        return {"weights": weights, "lora": lora}

    return app


SHUTDOWN_GRACE_S = 5.0  # after SIGTERM, how long requests have to answer before uvicorn cancels them


def _end_engine(engine: RolloutEngine, worker: Worker) -> None:
    """Shut `engine` down once the worker has finished its running call (told to stop at its next step); where that
    call has not ended within STUCK_GRACE_S, the engine's processes are killed rather than asked to close."""
    worker.close()
    worker.join()
    worker.thread.join(STUCK_GRACE_S)
    if worker.thread.is_alive():
        for p in getattr(engine, "processes", ()):
            p.kill()
    engine.shutdown()


def serve(checkpoint: str, host: str, port: int, patch_group: str = "none",
          disabled_patches: tuple[str, ...] = (), device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
          limits: Limits = Limits(), default_seed: int = 0, weights_root: str | None = None, tp: int = 1) -> None:
    """Builds the engine once (with `tp` > 1 a tensor-parallel `EngineClient`, a process per rank, each with this
    process's intra-op thread count), then serves it until SIGTERM or SIGINT: then it takes no more work, stops the
    running rollout at its next step, answers the waiting requests 503, ends the engine's processes and exits."""
    import uvicorn

    engine: RolloutEngine | None = None
    try:
        if tp > 1:
            from ..sync.engine_process import EngineClient

            engine = EngineClient(checkpoint, patch_group, disabled_patches, device, dtype,
                                  threads=torch.get_num_threads(), tp=tp)
        else:
            engine = Engine(checkpoint, patch_group, disabled_patches, device, dtype)
        app = create_app(engine, limits, default_seed, weights_root, torch.get_num_threads() if tp > 1 else None)

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
                app.state.worker.close()  # uvicorn alone would wait for the running request, however long
                super().handle_exit(sig, frame)

            async def shutdown(self, sockets: list | None = None) -> None:
                await super().shutdown(sockets)
                if tp > 1:  # now, not after `run`: uvicorn then re-raises the signal, which ends this process at once
                    await asyncio.to_thread(_end_engine, engine, app.state.worker)

        Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                              timeout_graceful_shutdown=SHUTDOWN_GRACE_S)).run()
    except KeyboardInterrupt:  # Ctrl-C while loading, or the SIGINT uvicorn re-raises once it has shut down
        pass
    finally:
        if engine is not None:  # a second shutdown does nothing
            engine.shutdown()


# -- clients ---------------------------------------------------------------------------------------------------
class ServerError(RuntimeError):
    """An error answer of the engine server."""

    def __init__(self, status: int, message: str):
        super().__init__(f"engine server answered {status}: {message}")
        self.status, self.message = status, message


def raise_for_error(r: httpx.Response) -> httpx.Response:
    if r.status_code != 200:
        try:
            message = r.json()["error"]
        except Exception:  # noqa: BLE001 - not our JSON: show the raw body
            message = r.text
        raise ServerError(r.status_code, message)
    return r


def remote_rollout(url: str, request: RolloutRequest, timeout: float = 3600.0) -> Rollout:
    """`Engine.rollout` run by the server at `url`: the same Rollout, bit for bit (tensors on the CPU)."""
    r = request
    body = msgpack.packb({"prompts": list(r.prompts), "n_per_prompt": r.n_per_prompt, "seed": r.seed,
                          "first_prompt": r.first_prompt, "decode": r.decode, "record_snapshot": r.record_snapshot,
                          **asdict(r.params)})
    r = httpx.post(f"{url.rstrip('/')}/rollout/generate", content=body, headers={"content-type": MSGPACK},
                   timeout=timeout)
    return wire.decode_rollout(raise_for_error(r).content)


def _push(url: str, state: dict[str, torch.Tensor], bucket_bytes: int, timeout: float, **fields: Any) -> dict:
    buckets = pack(state, bucket_bytes)
    r = httpx.post(url, content=wire.dump_handles(buckets, **fields),
                   headers={"content-type": wire.IPC_CONTENT_TYPE}, timeout=timeout)
    # `buckets` stays alive until here: the server has copied the update out of them before it answers.
    return raise_for_error(r).json()


def push_lora(url: str, state: dict[str, torch.Tensor], scale: float, merge_mode: str | None = None,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 600.0) -> str:
    """Send a LoRA (PEFT names) to the server on this machine by IPC handles; returns the server's LoRA checksum,
    `sync.checksum.tensors_checksum(state)` when `state` holds the engine dtype's tensors under diffusers names."""
    return _push(f"{url.rstrip('/')}/weights/lora", state, bucket_bytes, timeout, scale=float(scale),
                 merge_mode=merge_mode)["lora"]


def push_weights(url: str, state: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout: float = 600.0) -> str:
    """Send full transformer weights (diffusers names) by IPC handles; returns the server's weights checksum."""
    return _push(f"{url.rstrip('/')}/weights/full", state, bucket_bytes, timeout)["weights"]
