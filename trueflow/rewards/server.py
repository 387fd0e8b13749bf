"""The reward server (`trueflow reward-serve`): one Reward behind FastAPI, concurrent requests batched together.

Requests that arrive while the reward is busy, or within `max_wait_ms` of the first, are concatenated (per image
size) into one call of up to `max_batch` images, run on one worker thread (a model is never called concurrently)
and split back. If a merged call fails, each request is run alone, so one bad request fails only itself.
Scores go back raw: the client's `score` checks them, names failing prompts and applies its error policy.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated

import numpy as np
import torch
from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBytes, StrictInt, StrictStr, ValidationError, model_validator

from .base import Reward, as_scores, build_reward
from ..http import MSGPACK, BodyTooLarge, read_body, server_config
from .remote import pack_scores

# A /score body's default bound: 64 images of 1024² RGB (192 MiB) and their prompts, with room to spare.
MAX_BODY_BYTES = 256 << 20
_Count = Annotated[StrictInt, Field(ge=0)]
_Side = Annotated[StrictInt, Field(gt=0)]


class ScoreRequest(BaseModel):
    """The body of POST /score (`remote.pack_request` writes it). Strict types: no string taken for a list, no
    number for a string, no float or bool for a dimension; every image has at least one pixel."""

    model_config = ConfigDict(extra="forbid")

    shape: tuple[_Count, _Side, _Side, StrictInt]  # [N, H, W, 3]
    images: StrictBytes  # uint8, C order
    prompts: list[StrictStr]

    @model_validator(mode="after")
    def _consistent(self) -> ScoreRequest:
        shape, nbytes = list(self.shape), math.prod(self.shape)
        if shape[3] != 3:
            raise ValueError(f"shape {shape}: images must have 3 channels (RGB), got {shape[3]}")
        if shape[0] != len(self.prompts):
            raise ValueError(f"shape {shape} holds {shape[0]} images for {len(self.prompts)} prompts")
        if len(self.images) != nbytes:
            raise ValueError(f"images: {len(self.images)} bytes, the shape {shape} needs {nbytes}")
        return self


def _validation_message(e: ValidationError, shown: int = 5) -> str:
    """`field.index: reason (got value or type)` per problem, the first `shown` of them, on one line."""
    problems = []
    for err in e.errors(include_url=False)[:shown]:
        where, value = ".".join(str(x) for x in err["loc"]), err.get("input")
        got = "" if err["type"] == "missing" or err["type"].startswith("value_error") else \
            f" (got {value!r})" if isinstance(value, (int, float, type(None))) else f" (got {type(value).__name__})"
        problems.append(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}{got}")
    more = e.error_count() - shown
    return "bad request: " + "; ".join(problems) + (f"; and {more} more" if more > 0 else "")


def unpack_request(body: bytes) -> tuple[torch.Tensor, list[str]]:
    """A /score body -> (uint8 images [N, H, W, 3], N prompts); ValueError with the reason for any bad body."""
    import msgpack

    try:
        msg = msgpack.unpackb(body)
    except Exception as e:  # noqa: BLE001 - any undecodable body is the client's error
        raise ValueError(f"malformed request: not msgpack ({type(e).__name__}: {e})") from e
    try:
        req = ScoreRequest.model_validate(msg)
    except ValidationError as e:
        raise ValueError(_validation_message(e)) from None
    images = np.frombuffer(req.images, dtype=np.uint8).reshape(req.shape)
    return torch.from_numpy(images.copy()), req.prompts


_Item = tuple[torch.Tensor, list[str], "asyncio.Future[torch.Tensor]"]


class Batcher:
    def __init__(self, reward: Reward, max_batch: int = 64, max_wait_ms: float = 5.0):
        self.reward, self.max_batch, self.max_wait_s = reward, max_batch, max_wait_ms / 1000
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reward")
        self.requests = 0  # requests answered
        self.calls = 0  # reward calls made

    async def submit(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        await self.queue.put((images, prompts, future))
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            size, deadline = len(batch[0][1]), loop.time() + self.max_wait_s
            while size < self.max_batch:
                try:
                    item = self.queue.get_nowait() if loop.time() >= deadline else \
                        await asyncio.wait_for(self.queue.get(), deadline - loop.time())
                except (TimeoutError, asyncio.QueueEmpty):
                    break
                batch.append(item)
                size += len(item[1])
            by_size: dict[tuple[int, ...], list[_Item]] = {}
            for item in batch:
                by_size.setdefault(tuple(item[0].shape[1:]), []).append(item)
            for items in by_size.values():
                await self._run(items)

    def _score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        self.calls += 1
        return as_scores(self.reward.name, self.reward(images, prompts), prompts)

    async def _run(self, items: list[_Item]) -> None:
        images = torch.cat([i for i, _, _ in items]) if len(items) > 1 else items[0][0]
        prompts = [p for _, ps, _ in items for p in ps]
        try:
            scores = await asyncio.get_running_loop().run_in_executor(self.pool, self._score, images, prompts)
        except Exception as e:  # noqa: BLE001 - goes back to the client as its error
            if len(items) > 1:
                for item in items:
                    await self._run([item])
            elif not items[0][2].done():
                items[0][2].set_exception(e)
            return
        start = 0
        for _, ps, future in items:
            if not future.done():  # a client that went away cancelled its future
                future.set_result(scores[start:start + len(ps)])
            start += len(ps)


def create_app(reward: Reward, max_batch: int = 64, max_wait_ms: float = 5.0,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server of `reward`; a /score body past `max_body_bytes` is refused (413) before more of it is read."""
    batcher = Batcher(reward, max_batch, max_wait_ms)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.pool.shutdown(wait=False)

    app = FastAPI(title="trueflow reward server", lifespan=lifespan)
    app.state.batcher = batcher

    @app.get("/info")
    def info() -> dict:
        return {"name": reward.name, "requests": batcher.requests, "calls": batcher.calls}

    @app.post("/score")
    async def score(request: Request) -> Response:
        try:
            images, prompts = unpack_request(await read_body(request, max_body_bytes))
        except BodyTooLarge as e:
            raise HTTPException(413, str(e)) from None
        except ValueError as e:
            raise HTTPException(400, str(e)) from e
        try:
            scores = await batcher.submit(images, prompts)
        except Exception as e:  # noqa: BLE001
            raise HTTPException(500, f"{type(e).__name__}: {e}") from e
        finally:
            batcher.requests += 1
        return Response(pack_scores(scores), media_type=MSGPACK)

    return app


def serve(spec: str, host: str = "127.0.0.1", port: int = 8000, model_path: str | None = None,
          device: str = "cpu", max_batch: int = 64, max_wait_ms: float = 5.0, url: str | None = None,
          max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Builds the reward once (`url`: for the terms that take one), then serves it until interrupted."""
    import uvicorn

    app = create_app(build_reward(spec, model_path, device, url=url), max_batch, max_wait_ms, max_body_bytes)
    uvicorn.Server(server_config(app, host, port)).run()  # with header and body read deadlines (trueflow.http)
