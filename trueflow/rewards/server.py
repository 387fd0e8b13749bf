"""The reward server (`trueflow reward-serve`): one Reward behind FastAPI, concurrent requests batched together.

Requests that arrive while the reward is busy, or within `max_wait_ms` of the first, are concatenated (per image
size) into one call of up to `max_batch` images, run on one worker thread (a model is never called concurrently)
and split back. If a merged call fails, each request is run alone, so one bad request fails only itself.
Scores go back raw: the client's `score` checks them, names failing prompts and applies its error policy.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, HTTPException, Request, Response

from .base import Reward, as_scores, build_reward
from ..http import MSGPACK
from .remote import pack_scores, unpack_request

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


def create_app(reward: Reward, max_batch: int = 64, max_wait_ms: float = 5.0) -> FastAPI:
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
            images, prompts = unpack_request(await request.body())
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
          device: str = "cpu", max_batch: int = 64, max_wait_ms: float = 5.0) -> None:
    """Builds the reward once, then serves it until interrupted."""
    import uvicorn

    app = create_app(build_reward(spec, model_path, device), max_batch, max_wait_ms)
    uvicorn.run(app, host=host, port=port, log_level="info")
