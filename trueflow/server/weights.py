"""Weight updates: by a safetensors path under the server's `--weights-root`, or by IPC handles from a loopback
client, validated before anything is applied; and the token every `/weights/*` route asks for where the server
listens beyond loopback (docs/server.md, "Trust")."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Protocol, TypeVar, cast

import torch
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from safetensors.torch import load_file

from ..engine import wire
from ..loading import read_transformer_state_dict, transformer_dir
from ..sync.buckets import unpack
from .bodies import decode_body, read_body, validate
from .errors import RequestError
from .limits import IPC_PAYLOAD_BYTES, WEIGHT_JSON_BYTES

_M = TypeVar("_M", bound=BaseModel)


class _HasPath(Protocol):
    path: str
log = logging.getLogger(__name__)
TOKEN_ENV = "TRUEFLOW_ENGINE_TOKEN"  # the weights token: the server's, if set; what its clients send


def is_loopback(host: str | None) -> bool:
    """An address of this machine only: 127.0.0.0/8, ::1, or an IPv4-mapped loopback (::ffff:127.0.0.1), which
    Python 3.11's `is_loopback` does not count."""
    try:
        ip = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return ip.is_loopback or isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None \
        and ip.ipv4_mapped.is_loopback


def weights_token(host: str) -> str | None:
    """The token a server on `host` asks of every `/weights/*` request: `TRUEFLOW_ENGINE_TOKEN` if set; else, where
    it listens beyond loopback, a new random one (the caller prints it); on loopback alone, none."""
    token = os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(host) and host != "localhost":
        token = secrets.token_urlsafe(32)
    return token


class TokenGate:
    """ASGI middleware: a `/weights/*` request without `Authorization: Bearer <token>` is answered 401 before the
    route reads a byte of its body."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/weights/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.token):
                response = JSONResponse({"error": "the /weights/* routes of this server take its token (printed "
                                                  "when it started): send it as `Authorization: Bearer TOKEN`; "
                                                  f"trueflow's clients read it from {TOKEN_ENV}"}, 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


INDEX = "diffusion_pytorch_model.safetensors.index.json"  # the sharded-checkpoint index `loading` reads


def inside(root: Path, path: Path | str) -> Path | None:
    """`path` (relative to `root`, or absolute) with `..` and links resolved, if it lies inside `root`."""
    try:
        real = (root / path).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a link loop
        return None
    return real if real.is_relative_to(root) else None


def read_weights(root: Path | None, path: str, folders: bool) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (or, with `folders`, a checkpoint folder) under `root`. Refusals say
    nothing about anything outside `root` and never quote the file: its bytes may be anything."""
    if root is None:
        raise RequestError("weight loads by path are off on this server: start `trueflow serve` with "
                           "--weights-root DIR and send paths inside DIR, or send IPC handles", 403, param="path")
    outside = RequestError(f"the path {path!r} is not inside this server's --weights-root (relative paths are "
                           f"taken from it; '..' and links out of it are refused)", 403, param="path")
    real = inside(root, path)
    if real is None:
        raise outside
    if not real.exists():
        raise RequestError(f"nothing at {path!r} under the weights root", param="path")
    try:
        if not (folders and real.is_dir()):
            return load_file(real)
        d = transformer_dir(real)
        files = [d / INDEX] if (d / INDEX).is_file() else sorted(d.glob("*.safetensors"))
        if any(inside(root, f) is None for f in files):
            raise outside
        if files and files[0].name == INDEX:  # the shards the index names must lie inside too
            shards = json.loads(files[0].read_text())["weight_map"].values()
            if any(inside(root, d / s) is None for s in shards):
                raise outside
        return read_transformer_state_dict(d)
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file, a folder that is no checkpoint: logged, not echoed
        log.warning("weights at %s: %s: %s", real, type(e).__name__, e)
        raise RequestError(f"cannot read weights from {path!r}: not a readable safetensors file"
                           f"{' or checkpoint folder' if folders else ''} (the server's log has the details)",
                           param="path") from None


def check_weights(state: dict[str, torch.Tensor]) -> None:
    """Refuse non-float and non-finite tensors before anything is applied (the engine checks names and shapes)."""
    problems = []
    for what, bad in (("not floating point", lambda t: not t.is_floating_point()),
                      ("NaN or inf values", lambda t: t.is_floating_point() and not torch.isfinite(t).all())):
        names = sorted(n for n, t in state.items() if bad(t))
        if names:
            problems.append(f"{what} in {len(names)} tensor(s): {', '.join(names[:20])}{' ...' * (len(names) > 20)}")
    if problems:
        raise RequestError("weights refused, nothing applied: " + "; ".join(problems))


async def weights_request(request: Request, model: type[_M], by_path: type[_M], folders: bool,
                           root: Path | None, tp: int = 1) -> tuple[dict[str, torch.Tensor], _M]:
    """(tensors, other fields) of a weight update, from a safetensors path (JSON) or IPC handles, validated. A
    tensor-parallel engine (`tp` > 1) takes CPU handles only: it forwards the update to its ranks' processes from
    this one, which opens no GPU memory."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind == "application/json":
        body = decode_body(await read_body(request, WEIGHT_JSON_BYTES), "JSON")
        fields_ = validate(by_path, body)
        # `by_path` is one of the *ByPath bodies (bodies.LoraByPath, FullByPath)
        state = await asyncio.to_thread(read_weights, root, cast(_HasPath, fields_).path, folders)
    elif kind == wire.IPC_CONTENT_TYPE:
        if not is_loopback(request.client.host if request.client else None):
            raise RequestError("IPC handles are taken from loopback clients only: they name memory of the sender's "
                               "machine", 403)
        payload = await read_body(request, IPC_PAYLOAD_BYTES)
        try:
            handles = wire.parse_handles(payload)  # checked whole; nothing opened yet
        except ValueError as e:
            raise RequestError(str(e)) from e
        if tp > 1 and handles.cuda:
            raise RequestError(f"this server's engine is tensor-parallel (--tp {tp}, a process per rank), and it takes "
                               f"IPC weight updates from CPU tensors (shared memory) only: send the tensors moved to "
                               f"the CPU (push_lora(url, {{k: v.cpu() for k, v in state.items()}}, scale)), or a "
                               f"path under its --weights-root")
        fields_ = validate(model, handles.fields)
        try:
            buckets = await asyncio.to_thread(wire.open_handles, handles)
        except ValueError as e:
            raise RequestError(str(e)) from e
        state = unpack(buckets)
    else:
        raise RequestError(f"content-type must be application/json (a safetensors path) or {wire.IPC_CONTENT_TYPE} "
                           f"(IPC handles), got {kind or 'none'!r}", 415)
    await asyncio.to_thread(check_weights, state)
    return state, fields_
