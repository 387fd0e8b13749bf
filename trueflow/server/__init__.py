"""The engine server (`trueflow serve`, docs/server.md): one rollout engine behind FastAPI.

Every engine call (a rollout, a weight update, a checksum) runs on one worker thread, in arrival order (`worker`):
the engine is not thread-safe, and an update queued behind a rollout lands after that rollout's last step, never
inside it. Requests are not merged across clients. A microgroup is one batch through the denoise loop; running two
requests' microgroups as one larger batch changes the GEMMs' batch size, which changes bf16 bits on GPU (batch 4 vs
4 x batch 1 differed by 7.8e-3 on an H200), and concatenating their prompts into one rollout renumbers the prompts,
which changes their noise streams. So each request runs alone, exactly as `Engine.rollout` with its arguments: its
result is bitwise the same however busy the server is. The batch-invariant mode (`serve --batch-invariant`) lifts
the first reason: there an in-process engine runs up to `--max-merged` rollouts beside each other, each with its own
prompts, seeds and noise streams, and merges their forwards into one batch per step (`engine.batcher`), and each
result is still bitwise that request's alone. Parsing, encoding and weight validation run off the worker.

Every request's work is bounded before it reaches the worker (`limits`), and a running rollout stops at its next
denoising step when its client leaves, its time is up, or the server shuts down.

The parts: `errors` (the refusals and their bodies), `limits` (what one request may ask), `worker` (the engine
thread and its queue), `bodies` (the request types, strictly validated), `weights` (weight updates by path or IPC
handles), `app` (the routes), `lifecycle` (building the engine through the placement factory, serving, shutting
down). The app holds its engine through the engine interface: an in-process `Engine`, or with `--tp N` a
tensor-parallel engine over N processes (docs/tensor-parallel.md), which the server ends before it exits. The
client side is `trueflow.placement.http`, which imports none of this.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .errors import RequestError
    from .lifecycle import serve
    from .limits import Limits

__all__ = ["Limits", "RequestError", "create_app", "serve"]
# Imported on first use (PEP 562): `trueflow serve` checks its limits (`server.limits`) before FastAPI and the
# engine's modules load.
_HOME = {"Limits": "limits", "RequestError": "errors", "create_app": "app", "serve": "lifecycle"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
