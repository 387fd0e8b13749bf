"""`RemoteReward`: the Reward interface over HTTP, for a reward served by `trueflow reward-serve`.

Wire format (msgpack, raw bytes so images and scores cross exactly, NaN included):
request `{"shape": [N, H, W, 3], "images": uint8 bytes, "prompts": [N strings]}` to POST /score,
answer `{"scores": float32 bytes}`; a failure answers a non-200 status with JSON `{"detail": message}` (400 for a
body that breaks these types: `rewards.server.ScoreRequest` checks them strictly).
GET /info answers `{"name", "requests", "calls"}`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..http import MSGPACK
from .errors import RewardError, RewardTimeout


def pack_request(images: torch.Tensor, prompts: Sequence[str]) -> bytes:
    import msgpack

    return msgpack.packb({"shape": list(images.shape), "images": images.contiguous().numpy().tobytes(),
                          "prompts": list(prompts)})


def pack_scores(scores: torch.Tensor) -> bytes:
    import msgpack

    return msgpack.packb({"scores": scores.to(torch.float32).contiguous().numpy().tobytes()})


def unpack_scores(body: bytes) -> torch.Tensor:
    import msgpack

    return torch.from_numpy(np.frombuffer(msgpack.unpackb(body)["scores"], dtype=np.float32).copy())


class RemoteReward:
    """A client of a reward server. Its name is the server's reward name with the URL; raises RewardError (or
    RewardTimeout after `timeout` seconds) naming the prompts of the request."""

    def __init__(self, url: str, timeout: float = 300.0):
        import httpx

        self.url, self.timeout = url.rstrip("/"), timeout
        self._client = httpx.Client(timeout=timeout)
        try:
            info = self._client.get(f"{self.url}/info")
            info.raise_for_status()
        except httpx.HTTPError as e:
            raise ConnectionError(f"no reward server answers at {self.url}: {e}") from e
        self.name = f"{info.json()['name']}@{self.url}"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        import httpx

        try:
            r = self._client.post(f"{self.url}/score", content=pack_request(images, prompts),
                                  headers={"content-type": MSGPACK})
        except httpx.TimeoutException:
            raise RewardTimeout(self.name, prompts, f"no answer within {self.timeout:g} s") from None
        except httpx.HTTPError as e:
            raise RewardError(self.name, prompts, f"request failed: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            try:
                detail = r.json()["detail"]
            except Exception:  # noqa: BLE001 - not our JSON: show the raw body
                detail = r.text
            raise RewardError(self.name, prompts, f"server answered {r.status_code}: {detail}")
        return unpack_scores(r.content)

    def close(self) -> None:
        self._client.close()
