"""The engine interface (`interface.RolloutEngine`) over HTTP: a `trueflow serve` server, as a trainer's engine.

Rollouts come back bit for bit (`wire`); weights go as IPC handles (shared memory on CPU, CUDA IPC on GPU), so the
server must be on this machine and answer on loopback (docs/server.md). A tensor-parallel server (`serve --tp N`, its
health says `tp`) forwards an update to its ranks' processes and so takes CPU handles only: a LoRA goes to it as CPU
copies.
"""

from __future__ import annotations

import httpx
import torch

from ..sync.buckets import DEFAULT_BUCKET_BYTES
from .interface import RolloutRequest
from .server import ServerError, push_lora, push_weights, raise_for_error, remote_rollout
from .trajectory import Rollout


class HttpEngine:
    def __init__(self, url: str, timeout: float = 3600.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.url, self.timeout, self.bucket_bytes = url.rstrip("/"), timeout, bucket_bytes
        try:  # fails now, naming the URL and the fix, rather than at the first rollout
            health = self.health()
        except ServerError as e:
            raise ValueError(e.message) from None
        status, self.tp = health.get("status"), health.get("tp", 1)
        if status != "ok":
            raise ValueError(f"the engine server at {self.url} is not ready (status {status!r})")

    def rollout(self, request: RolloutRequest) -> Rollout:
        return remote_rollout(self.url, request, self.timeout)

    def update_weights(self, state: dict[str, torch.Tensor], lora_scale: float | None = None,
                       merge_mode: str | None = None) -> str:
        if lora_scale is None:
            return push_weights(self.url, state, self.bucket_bytes)
        if self.tp > 1:  # its ranks' processes cannot open CUDA IPC handles sent to the server's process
            state = {k: v.detach().cpu() for k, v in state.items()}
        return push_lora(self.url, state, lora_scale, merge_mode, self.bucket_bytes)

    def checksum(self) -> str:
        return raise_for_error(httpx.get(f"{self.url}/weights/checksum", timeout=self.timeout)).json()["lora"]

    def health(self) -> dict:
        try:
            r = httpx.get(f"{self.url}/health", timeout=30)
        except httpx.HTTPError as e:
            raise ServerError(0, f"no engine server answers at {self.url} ({type(e).__name__}); start one with "
                                 f"`trueflow serve --checkpoint DIR --port PORT`") from e
        return r.json()  # 503 answers still carry the health object ("stuck", "shutting_down")

    def shutdown(self) -> None:
        """The server is not this process's: it keeps serving."""
