"""The engine server (`trueflow serve`): one rollout Engine behind FastAPI, and its clients (docs/server.md).

Every engine call (a rollout, a weight update, a checksum) runs on one worker thread, in arrival order: the engine
is not thread-safe, and an update queued behind a rollout lands after that rollout's last step, never inside it.
Requests are not merged across clients. A microgroup is one batch through the denoise loop; running two requests'
microgroups as one larger batch changes the GEMMs' batch size, which changes bf16 bits on GPU (DESIGN 3: batch 4
vs 4 x batch 1 differs by 7.8e-3), and concatenating their prompts into one rollout renumbers the prompts, which
changes their noise streams. So each request runs alone, exactly as `Engine.rollout` with its arguments: its
result is bitwise the same however busy the server is. Parsing, encoding and weight validation run off the worker.
"""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import json
import re
import sys
import time
import types
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgpack
import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from safetensors.torch import load_file
from starlette.exceptions import HTTPException

from ..http import MSGPACK
from ..loading import read_transformer_state_dict
from ..sync.buckets import DEFAULT_BUCKET_BYTES, pack, unpack
from . import wire
from .engine import Engine, SamplingParams
from .trajectory import Rollout

_T = TypeVar("_T")


class RequestError(Exception):
    """A request the server refuses: answered with `status` and JSON {"error": message}; the server keeps serving."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Worker:
    """Runs engine calls one at a time, in arrival order, on one thread."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.depth = 0  # calls waiting or running

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        self.depth += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except ValueError as e:  # the engine's contract: a ValueError is the caller's bad input, nothing applied
            raise RequestError(str(e)) from e
        finally:
            self.depth -= 1


# -- request fields --------------------------------------------------------------------------------------------
_SAMPLING = typing.get_type_hints(SamplingParams)  # field -> type, so a new sampling field is served as it lands
_ROLLOUT = {"prompts": list[str], "n_per_prompt": int, "seed": int, "decode": bool, "record_snapshot": bool,
            **_SAMPLING}
_OPENAI = {"prompt": str, "n": int, "size": str, "response_format": str, "model": str, "seed": int,
           **{k: _SAMPLING[k] for k in ("steps", "cfg_scale", "sampler", "negative_prompt")}}
_LORA = {"scale": float, "merge_mode": str | None}


def _conforms(v: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(v, a) for a in args)
    if origin is tuple:
        return isinstance(v, (list, tuple)) and len(v) == len(args) and all(map(_conforms, v, args))
    if origin is list:
        return isinstance(v, list) and all(_conforms(x, args[0]) for x in v)
    if hint in (int, float) and isinstance(v, bool):  # bool is an int subclass; true is no step count
        return False
    if hint is float:  # JSON and msgpack may send 1 for 1.0; NaN and inf pass no engine check, so refuse them here
        return isinstance(v, (int, float)) and abs(v) <= sys.float_info.max
    return isinstance(v, hint)


def _type_name(hint: Any) -> str:
    return "a finite float" if hint is float else hint.__name__ if isinstance(hint, type) else str(hint)


def _fields(body: Any, schema: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The body's fields checked against `schema` (name -> type); unknown, missing and mistyped ones are refused
    by name. Floats come back as Python floats."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a map of fields, got {type(body).__name__}")
    unknown = sorted(map(str, set(body) - set(schema)))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; this endpoint takes "
                           f"{', '.join(sorted(schema))}")
    missing = [k for k in required if k not in body]
    if missing:
        raise RequestError(f"missing field(s) {', '.join(map(repr, missing))}")
    for k, v in body.items():
        if not _conforms(v, schema[k]):
            raise RequestError(f"field {k!r} must be {_type_name(schema[k])}, got {type(v).__name__} {v!r:.100}")
    if not -2**63 <= body.get("seed", 0) < 2**63:  # seeds are hashed as signed 64-bit integers
        raise RequestError(f"field 'seed' must fit a signed 64-bit integer, got {body['seed']}")
    return {k: float(v) if schema[k] is float else v for k, v in body.items()}


def _body(data: bytes, fmt: str) -> Any:
    try:
        return msgpack.unpackb(data) if fmt == "msgpack" else json.loads(data)
    except Exception as e:  # noqa: BLE001 - any undecodable body is the client's error
        raise RequestError(f"malformed {fmt} body ({type(e).__name__}: {e})") from e


def _sampling_params(fields: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if k in _SAMPLING})
    except ValueError as e:
        raise RequestError(str(e)) from e


# -- weights ---------------------------------------------------------------------------------------------------
def _is_loopback(host: str | None) -> bool:
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def _read_weights(path: str, folders: bool) -> dict[str, torch.Tensor]:
    try:
        return read_transformer_state_dict(path) if folders and Path(path).is_dir() else load_file(path)
    except Exception as e:  # noqa: BLE001 - a missing, unreadable or corrupt file is the client's error
        raise RequestError(f"cannot read weights from {path!r}: {type(e).__name__}: {e}") from e


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


async def _weights_request(request: Request, schema: dict[str, Any], required: tuple[str, ...],
                           folders: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, other fields) of a weight update, from a safetensors path (JSON) or IPC handles, validated."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    body = await request.body()
    if kind == "application/json":
        fields = _fields(_body(body, "JSON"), {"path": str, **schema}, ("path", *required))
        state = await asyncio.to_thread(_read_weights, fields.pop("path"), folders)
    elif kind == wire.IPC_CONTENT_TYPE:
        if not _is_loopback(request.client.host if request.client else None):
            raise RequestError("IPC handles are taken from loopback clients only: the payload is a pickle, and "
                               "handles only open on the sender's machine", 403)
        try:
            buckets, rest = await asyncio.to_thread(wire.load_handles, body)
        except ValueError as e:
            raise RequestError(str(e)) from e
        fields, state = _fields(rest, schema, required), unpack(buckets)
    else:
        raise RequestError(f"content-type must be application/json (a safetensors path) or {wire.IPC_CONTENT_TYPE} "
                           f"(IPC handles), got {kind or 'none'!r}", 415)
    await asyncio.to_thread(_check_weights, state)
    return state, fields


def _png_b64(image: torch.Tensor) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image.numpy()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


# -- the app ---------------------------------------------------------------------------------------------------
def create_app(engine: Engine, max_batch: int = 64, default_seed: int = 0) -> FastAPI:
    """The server of `engine`. `max_batch`: most samples (prompts x n) one generation request may ask for;
    `default_seed`: the seed of OpenAI-style requests that name none."""
    worker = Worker()
    threads = worker.pool.submit(torch.get_num_threads).result()  # what the engine's thread runs with (DESIGN 3, 9)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        worker.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="trueflow engine server", lifespan=lifespan)

    async def refused(_request: Request, e: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, e.status)

    async def http_error(_request: Request, e: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return JSONResponse({"error": e.detail}, e.status_code)

    async def failed(_request: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"error": f"{type(e).__name__}: {e}"}, 500)

    app.add_exception_handler(RequestError, refused)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, failed)

    def check_size(samples: int) -> None:
        if samples > max_batch:
            raise RequestError(f"the request asks for {samples} samples; this server takes at most {max_batch} per "
                               f"request (--max-batch)")

    def rollout(prompts: list[str], n: int, params: SamplingParams, seed: int, decode: bool,
                record_snapshot: bool) -> Rollout:
        out = engine.rollout(prompts, n, params, seed, decode, record_snapshot)
        out.engine["lora_checksum"] = engine.lora_checksum()  # in the same call: the LoRA this rollout ran with
        return out

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "checkpoint": engine.checkpoint, "patch_group": engine.patch_group,
                "disabled_patches": list(engine.disabled_patches),
                "patches_applied": list(engine.transformer.patches_applied),
                "dtype": str(engine.dtype).removeprefix("torch."), "device": str(engine.device), "threads": threads,
                "max_batch": max_batch, "queue_depth": worker.depth}

    @app.post("/rollout/generate")
    async def generate(request: Request) -> Response:
        f = _fields(_body(await request.body(), "msgpack"), _ROLLOUT, ("prompts", "n_per_prompt", "seed"))
        params = _sampling_params(f)
        check_size(len(f["prompts"]) * f["n_per_prompt"])
        out = await worker.run(rollout, f["prompts"], f["n_per_prompt"], params, f["seed"], f.get("decode", True),
                               f.get("record_snapshot", False))
        return Response(await asyncio.to_thread(wire.encode_rollout, out), media_type=MSGPACK)

    @app.post("/v1/images/generations")
    async def images(request: Request) -> dict:
        f = _fields(_body(await request.body(), "JSON"), _OPENAI, ("prompt",))
        if f.get("response_format", "b64_json") != "b64_json":
            raise RequestError(f"response_format must be 'b64_json' (this server keeps no image URLs), "
                               f"got {f['response_format']!r}")
        defaults = SamplingParams()
        size = f.get("size", f"{defaults.width}x{defaults.height}")
        m = re.fullmatch(r"(\d+)x(\d+)", size)
        if not m:
            raise RequestError(f"size must be 'WIDTHxHEIGHT' in pixels, e.g. '64x64', got {size!r}")
        params = _sampling_params({**f, "width": int(m[1]), "height": int(m[2])})
        n, seed = f.get("n", 1), f.get("seed", default_seed)
        check_size(n)
        out = await worker.run(engine.rollout, [f["prompt"]], n, params, seed)
        data = await asyncio.to_thread(lambda: [{"b64_json": _png_b64(image)} for image in out.images])
        return {"created": int(time.time()), "seed": seed, "data": data}

    @app.post("/weights/lora")
    async def weights_lora(request: Request) -> dict:
        state, f = await _weights_request(request, _LORA, ("scale",), folders=False)

        def apply() -> str:
            engine.update_lora(state, f["scale"], f.get("merge_mode"))
            return engine.lora_checksum()

        return {"lora": await worker.run(apply)}

    @app.post("/weights/full")
    async def weights_full(request: Request) -> dict:
        state, _ = await _weights_request(request, {}, (), folders=True)

        def apply() -> str:
            engine.load_weights(state)
            return engine.weights_checksum()

        return {"weights": await worker.run(apply)}

    @app.get("/weights/checksum")
    async def checksum() -> dict:
        weights, lora = await worker.run(lambda: (engine.weights_checksum(), engine.lora_checksum()))
        return {"weights": weights, "lora": lora}

    return app


def serve(checkpoint: str, host: str, port: int, patch_group: str = "none",
          disabled_patches: tuple[str, ...] = (), device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
          max_batch: int = 64, default_seed: int = 0) -> None:
    """Builds the engine once, then serves it until interrupted."""
    import uvicorn

    engine = Engine(checkpoint, patch_group, disabled_patches, device, dtype)
    uvicorn.run(create_app(engine, max_batch, default_seed), host=host, port=port, log_level="info")


# -- clients ---------------------------------------------------------------------------------------------------
class ServerError(RuntimeError):
    """An error answer of the engine server."""

    def __init__(self, status: int, message: str):
        super().__init__(f"engine server answered {status}: {message}")
        self.status, self.message = status, message


def _answer(r: httpx.Response) -> httpx.Response:
    if r.status_code != 200:
        try:
            message = r.json()["error"]
        except Exception:  # noqa: BLE001 - not our JSON: show the raw body
            message = r.text
        raise ServerError(r.status_code, message)
    return r


def remote_rollout(url: str, prompts: list[str], n_per_prompt: int, params: SamplingParams, seed: int,
                   decode: bool = True, record_snapshot: bool = False, timeout: float = 3600.0) -> Rollout:
    """`Engine.rollout` run by the server at `url`: the same Rollout, bit for bit (tensors on the CPU)."""
    body = msgpack.packb({"prompts": list(prompts), "n_per_prompt": n_per_prompt, "seed": seed, "decode": decode,
                          "record_snapshot": record_snapshot, **asdict(params)})
    r = httpx.post(f"{url.rstrip('/')}/rollout/generate", content=body, headers={"content-type": MSGPACK},
                   timeout=timeout)
    return wire.decode_rollout(_answer(r).content)


def _push(url: str, state: dict[str, torch.Tensor], bucket_bytes: int, timeout: float, **fields: Any) -> dict:
    buckets = pack(state, bucket_bytes)
    r = httpx.post(url, content=wire.dump_handles(buckets, **fields),
                   headers={"content-type": wire.IPC_CONTENT_TYPE}, timeout=timeout)
    # `buckets` stays alive until here: the server has copied the update out of them before it answers.
    return _answer(r).json()


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
