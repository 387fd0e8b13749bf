"""The engine interface over HTTP: a `trueflow serve` server as an engine, and the client calls it is made of.

Rollouts come back bit for bit (`engine.wire`); weights go as IPC handles (shared-memory segments of this process on
CPU, `sync.shm`; CUDA IPC on GPU), so the server must be on this machine and answer on loopback (docs/server.md). A
tensor-parallel server (`serve --tp N`, its health says `tp`) forwards an update to its ranks' processes and so takes
CPU handles only: a LoRA goes to it as CPU copies. Every call sends the server's weights token, where
`TRUEFLOW_ENGINE_TOKEN` holds one. This module imports no FastAPI: a trainer that talks to a server never loads the
server's stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import msgpack

from ..engine import wire
from ..engine.interface import EngineDied, RolloutCancelled, RolloutRequest, StopCheck
from ..http import MSGPACK
from ..sync.buckets import DEFAULT_BUCKET_BYTES, BucketPacker, pack
from ..sync.shm import SharedSegments
from .spec import EngineSpec, Placement

if TYPE_CHECKING:
    import torch

    from ..engine.trajectory import Rollout

STOP_POLL_S = 0.2  # how often a waiting rollout asks its `should_stop`
TOKEN_ENV = "TRUEFLOW_ENGINE_TOKEN"  # as `server.weights.TOKEN_ENV` (not imported: it would load FastAPI)


def auth_headers() -> dict[str, str]:
    """The server's weights token, where `TRUEFLOW_ENGINE_TOKEN` holds it (docs/server.md, "Trust")."""
    token = os.environ.get(TOKEN_ENV)
    return {"authorization": f"Bearer {token}"} if token else {}


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


def remote_rollout(url: str, request: RolloutRequest, timeout: float = 3600.0,
                   should_stop: StopCheck | None = None) -> Rollout:
    """`Engine.rollout` run by the server at `url`: the same Rollout, bit for bit (tensors on the CPU). With
    `should_stop`, asked every STOP_POLL_S while the server works: a true answer closes the connection (the server
    stops the rollout at its next denoising step when its client leaves) and raises RolloutCancelled."""
    r = request
    body = msgpack.packb({"prompts": list(r.prompts), "n_per_prompt": r.n_per_prompt, "seed": r.seed,
                          "first_prompt": r.first_prompt, "decode": r.decode, "record_snapshot": r.record_snapshot,
                          **asdict(r.params)})
    post = dict(url=f"{url.rstrip('/')}/rollout/generate", content=body, headers={"content-type": MSGPACK},
                timeout=timeout)
    if should_stop is None:
        return wire.decode_rollout(raise_for_error(httpx.post(**post)).content)
    return wire.decode_rollout(raise_for_error(asyncio.run(_stoppable_post(post, should_stop))).content)


async def _stoppable_post(post: dict, should_stop: StopCheck) -> httpx.Response:
    """The POST, cancelled (its connection closed) once `should_stop` says so: asked at once, then every STOP_POLL_S."""
    async with httpx.AsyncClient() as client:
        call = asyncio.ensure_future(client.post(**post))
        while not should_stop():
            done, _ = await asyncio.wait({call}, timeout=STOP_POLL_S)
            if done:
                return call.result()
        call.cancel()  # the server sees its client leave and stops the rollout at its next denoising step
        with contextlib.suppress(asyncio.CancelledError):
            await call
        raise RolloutCancelled("stopped: the caller's should_stop said so")


def _push(url: str, state: dict[str, torch.Tensor], bucket_bytes: int, timeout: float,
          packer: tuple[BucketPacker, SharedSegments] | None, **fields: Any) -> dict:
    """POST `state` as IPC handles: packed by `packer` (its buffers kept for the next update) or, without one, into
    segments of this call that are unlinked once the server has answered."""
    segments = SharedSegments() if packer is None else packer[1]
    try:
        buckets = pack(state, bucket_bytes, segments.allocate) if packer is None else packer[0].pack(state)
        r = httpx.post(url, content=wire.dump_handles(buckets, segments, **fields),
                       headers={"content-type": wire.IPC_CONTENT_TYPE, **auth_headers()}, timeout=timeout)
        # `buckets` stays alive until here: the server has copied the update out of them before it answers.
        return raise_for_error(r).json()
    finally:
        if packer is None:
            segments.close()


def push_lora(url: str, state: dict[str, torch.Tensor], scale: float, merge_mode: str | None = None,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = 600.0,
              packer: tuple[BucketPacker, SharedSegments] | None = None) -> str:
    """Send a LoRA (PEFT names) to the server on this machine by IPC handles; returns the server's LoRA checksum,
    `sync.checksum.tensors_checksum(state)` when `state` holds the engine dtype's tensors under diffusers names.
    `packer`: a BucketPacker whose allocator is the SharedSegments beside it, reused from update to update."""
    return _push(f"{url.rstrip('/')}/weights/lora", state, bucket_bytes, timeout, packer, scale=float(scale),
                 merge_mode=merge_mode)["lora"]


def push_weights(url: str, state: dict[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout: float = 600.0) -> str:
    """Send full transformer weights (diffusers names) by IPC handles; returns the server's weights checksum."""
    return _push(f"{url.rstrip('/')}/weights/full", state, bucket_bytes, timeout, None)["weights"]


class HttpEngine:
    """A `trueflow serve` server at `url` behind the engine interface. A server that stops answering (gone, or a 5xx:
    a dead rank, shutting down) raises EngineDied naming it; a refused request (4xx) raises ServerError."""

    def __init__(self, url: str, timeout: float = 3600.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.url, self.timeout, self.bucket_bytes = url.rstrip("/"), timeout, bucket_bytes
        self.segments = SharedSegments()  # the LoRA's buffers, refilled every sync; unlinked at shutdown
        self.packer = BucketPacker(bucket_bytes, self.segments.allocate)
        try:  # fails now, naming the URL and the fix, rather than at the first rollout
            health = self.health()
        except ServerError as e:
            raise ValueError(e.message) from None
        status, self.tp = health.get("status"), health.get("tp", 1)
        if status != "ok":
            raise ValueError(f"the engine server at {self.url} is not ready (status {status!r})")
        self.served = health

    @classmethod
    def from_placement(cls, spec: EngineSpec, placement: Placement) -> HttpEngine:
        """The `http` placement: the server must run what `spec` asks (`check_serves`)."""
        assert placement.url is not None  # Placement refuses an http placement without one
        engine = cls(placement.url, bucket_bytes=placement.bucket_bytes or DEFAULT_BUCKET_BYTES)
        check_serves(spec, engine.served, engine.url)
        return engine

    @contextlib.contextmanager
    def _answering(self):
        try:
            yield
        except httpx.TransportError as e:
            raise EngineDied(f"the engine server at {self.url} is gone ({type(e).__name__}: {e})") from None
        except ServerError as e:
            if e.status < 500:
                raise
            raise EngineDied(f"the engine server at {self.url} answered {e.status}: "
                             f"{' '.join(str(e.message).split())[:300]}") from None

    def rollout(self, request: RolloutRequest, should_stop: StopCheck | None = None) -> Rollout:
        with self._answering():
            return remote_rollout(self.url, request, self.timeout, should_stop)

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        with self._answering():
            if lora_scale is None:
                return push_weights(self.url, state, self.bucket_bytes)
            if self.tp > 1:  # its ranks' processes cannot open CUDA IPC handles sent to the server's process
                state = {k: v.detach().cpu() for k, v in state.items()}
            return push_lora(self.url, state, lora_scale, merge_mode, self.bucket_bytes,
                             packer=(self.packer, self.segments))

    def checksum(self) -> str:
        with self._answering():
            return raise_for_error(httpx.get(f"{self.url}/weights/checksum", headers=auth_headers(),
                                             timeout=self.timeout)).json()["lora"]

    def health(self) -> dict:
        try:
            r = httpx.get(f"{self.url}/health", timeout=30)
        except httpx.HTTPError as e:
            raise ServerError(0, f"no engine server answers at {self.url} ({type(e).__name__}); start one with "
                                 f"`trueflow serve --checkpoint DIR --port PORT`") from e
        return r.json()  # 503 answers still carry the health object ("stuck", "shutting_down")

    def shutdown(self) -> None:
        """The server is not this process's: it keeps serving. The update buffers are unlinked."""
        self.packer = BucketPacker(self.bucket_bytes, self.segments.allocate)
        self.segments.close()


def check_serves(spec: EngineSpec, health: dict, url: str) -> None:
    """A served engine must run what this caller would have started itself: the same checkpoint, patch group, dtype
    and (on CPU, parity condition 9) thread count."""
    import torch

    from ..dtypes import torch_dtype

    want: dict[str, Any] = {"checkpoint": str(Path(spec.checkpoint).resolve()), "patch_group": spec.patch_group,
            "disabled_patches": list(spec.disabled_patches),
            "dtype": str(torch_dtype(spec.dtype)).removeprefix("torch.")}
    got = {**{k: health.get(k) for k in want}, "checkpoint": str(Path(health.get("checkpoint", "")).resolve())}
    if str(health.get("device", "")).startswith("cpu"):
        want["threads"], got["threads"] = spec.threads or torch.get_num_threads(), health.get("threads")
    wrong = [f"{k} {got[k]!r} (this run: {want[k]!r})" for k in want if got[k] != want[k]]
    if wrong:
        raise ValueError(f"the engine server at {url} runs {', '.join(wrong)}; start it with this run's settings")
