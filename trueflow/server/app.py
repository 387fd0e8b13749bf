"""The routes: health, rollouts (msgpack, bit for bit), OpenAI-style images, weight updates and checksums."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import re
import secrets
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..engine import wire
from ..engine.sampling_params import SamplingParams, check_family_limits
from ..engine.interface import EngineDied, RolloutEngine, RolloutRequest
from ..engine.trajectory import Rollout
from ..http import MSGPACK
from ..kernels.batch_invariant import BACKEND as BATCH_INVARIANT
from ..models import get_family
from .bodies import IGNORED_HEADER, OPENAI_IGNORED, FullByPath, FullUpdate, ImagesRequest, LoraByPath, LoraUpdate, \
    RolloutBody, Sampling, decode_body, field_of, read_body, validate
from .errors import RequestError, error_body
from .limits import Limits, TokenCounter
from .weights import TokenGate, weights_request
from .worker import STUCK_GRACE_S, Worker

_T = TypeVar("_T")
log = logging.getLogger("uvicorn.error")  # where uvicorn logs: the server's own lines
SEED_BITS = 63  # a drawn seed: any non-negative signed 64-bit integer, as a request may name


def png_b64(image: torch.Tensor) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image.numpy()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def create_app(engine: RolloutEngine, limits: Limits = Limits(), default_seed: int | None = None,
               weights_root: str | Path | None = None, threads: int | None = None,
               token: str | None = None, max_merged: int = 8) -> FastAPI:
    """The server of `engine`: an engine interface whose `rollout` takes `should_stop` (an `Engine`, or an
    `EngineClient`, whose health says `tp`). `limits`: what one request may ask; `default_seed`: the seed of
    OpenAI-style requests that name none (None: each draws a new one, returned in its answer); `weights_root`: the
    folder path-based weight updates may read (None: none); `threads`: the engine's intra-op CPU threads where
    another process runs it (None: read on the worker); `token`: what every `/weights/*` request must bring
    (`server.weights.weights_token`; None: nothing); `max_merged`: in the batch-invariant mode, how many rollouts an
    in-process engine runs at once with their forwards merged (`server.worker`)."""
    root = None if weights_root is None else Path(weights_root).resolve()
    if root is not None and not root.is_dir():
        raise FileNotFoundError(f"--weights-root {weights_root}: no such folder")
    info = engine.health()  # what it runs, read once: an engine in other processes answers between calls only
    family, tp = get_family(info["family"]), info.get("tp", 1)
    model_id, started = Path(info["checkpoint"]).name, int(time.time())  # `/v1/models`' one model
    merges = info.get("patch_group", "").endswith(f":{BATCH_INVARIANT}") and hasattr(engine, "merge_forwards")
    batcher = engine.merge_forwards() if merges else None  # type: ignore[attr-defined]
    worker = Worker(batcher, max_merged)
    tokens = TokenCounter(info["checkpoint"])
    if threads is None:
        threads = worker.submit(lambda _stop: torch.get_num_threads()).future.result()  # the engine thread's count

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        worker.close()
        worker.join()

    app = FastAPI(title="trueflow engine server", lifespan=lifespan)
    app.state.worker = worker
    if token is not None:
        app.add_middleware(TokenGate, token=token)

    async def refused(request: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, str(e), e.status, e.param, e.code), e.status)

    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return JSONResponse(error_body(request.url.path, e.detail, e.status_code), e.status_code)

    async def engine_died(request: Request, e: EngineDied) -> JSONResponse:  # a rank's death: one line, 503
        return JSONResponse(error_body(request.url.path, str(e), 503, code="engine_died"), 503)

    async def failed(request: Request, e: Exception) -> JSONResponse:
        # One line; Starlette re-raises after this answer, and uvicorn logs the traceback.
        return JSONResponse(error_body(request.url.path, f"{type(e).__name__}: {e}", 500), 500)

    # Starlette types a handler as taking any Exception; it calls each with the class it is registered for
    app.add_exception_handler(RequestError, refused)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(EngineDied, engine_died)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, failed)

    async def generation(request: Request, samples: int, params: SamplingParams, prompts: list[str],
                         fn: Callable[[Callable[[], bool]], _T], arrived: float) -> _T:
        """Check the family's rules and `limits`, then run `fn` on the worker within the request's time, stopped if
        its client leaves."""
        try:
            check_family_limits(params, family)
        except ValueError as e:
            raise RequestError(str(e), param=field_of(str(e))) from e
        limits.check(samples, params, prompts)
        await asyncio.to_thread(tokens.check, limits, prompts, params.negative_prompt)
        job = worker.submit(fn, arrived + limits.request_timeout, limits.max_queue, merge=True)
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
            "running_for_s": None if age is None else round(age, 3), "limits": asdict(limits),
            **({} if batcher is None else {"merged_forwards": batcher.merged_forwards})},
            200 if status == "ok" else 503)

    @app.post("/rollout/generate")
    async def generate(request: Request) -> Response:
        arrived = time.monotonic()
        req = validate(RolloutBody, decode_body(await read_body(request, limits.generation_body_bytes),
                                           "msgpack")).request()

        def rollout(should_stop: Callable[[], bool]) -> Rollout:
            out = engine.rollout(req, should_stop=should_stop)
            out.engine["lora_checksum"] = engine.checksum()  # in the same call: the LoRA this rollout ran with
            return out

        out = await generation(request, len(req.prompts) * req.n_per_prompt, req.params, req.prompts, rollout,
                               arrived)
        return Response(await asyncio.to_thread(wire.encode_rollout, out), media_type=MSGPACK)

    @app.post("/v1/images/generations")
    async def images(request: Request) -> JSONResponse:
        arrived = time.monotonic()
        body = decode_body(await read_body(request, limits.generation_body_bytes), "JSON")
        ignored = sorted(k for k in body if k in OPENAI_IGNORED) if isinstance(body, dict) else []
        r = validate(ImagesRequest, {k: v for k, v in body.items() if k not in ignored} if ignored else body)
        if r.model is not None and r.model != model_id:
            ignored = sorted([*ignored, "model"])  # one model is served, whichever a client names
        if r.stream:
            raise RequestError("stream must be false: this server answers with one JSON object (no partial "
                               "images)", param="stream")
        if r.response_format != "b64_json":
            raise RequestError(f"response_format must be 'b64_json' (this server keeps no image URLs), "
                               f"got {r.response_format!r}", param="response_format")
        m = re.fullmatch(r"(\d{1,6})x(\d{1,6})", ImagesRequest.model_fields["size"].default if r.size == "auto"
                         else r.size)
        if not m:
            raise RequestError(f"size must be 'WIDTHxHEIGHT' in pixels, e.g. '64x64', got {r.size!r:.100}",
                               param="size")
        params = Sampling(steps=r.steps, cfg_scale=r.cfg_scale, sampler=r.sampler, negative_prompt=r.negative_prompt,
                          width=int(m[1]), height=int(m[2])).params()
        try:  # a size the family cannot make is the `size` field's fault, whichever side it is
            check_family_limits(params, family)
        except ValueError as e:
            raise RequestError(f"size {r.size}: {e}", param="size" if field_of(str(e)) in ("height", "width")
                               else field_of(str(e))) from e
        seed = r.seed if r.seed is not None else default_seed if default_seed is not None else \
            secrets.randbits(SEED_BITS)
        out = await generation(request, r.n, params, [r.prompt],
                               lambda stop: engine.rollout(RolloutRequest([r.prompt], r.n, params, seed),
                                                           should_stop=stop), arrived)
        images = out.images
        assert images is not None  # a served rollout decodes
        data = await asyncio.to_thread(lambda: [{"b64_json": png_b64(image)} for image in images])
        headers = {}
        if ignored:
            headers[IGNORED_HEADER] = ", ".join(ignored)
            log.info("/v1/images/generations: ignored the OpenAI field(s) %s (this server has no such setting)",
                     ", ".join(ignored))
        return JSONResponse({"created": int(time.time()), "seed": seed, "data": data}, headers=headers)

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": started, "owned_by": "trueflow",
                "family": family.name, "patch_group": info.get("patch_group")}

    @app.get("/v1/models")
    async def models() -> dict:
        """OpenAI's model list: the one model served (named after its checkpoint folder)."""
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        if name != model_id:
            raise RequestError(f"no model {name!r} here; this server serves {model_id!r} (GET /v1/models)", 404,
                               param="model", code="model_not_found")
        return model_card()

    @app.post("/weights/lora")
    async def weights_lora(request: Request) -> dict:
        state, f = await weights_request(request, LoraUpdate, LoraByPath, False, root, tp)

        def apply(_stop: Callable[[], bool]) -> str:
            return engine.update_weights(state, f.scale, f.merge_mode)

        return {"lora": await worker.wait(worker.submit(apply), request)}

    @app.post("/weights/full")
    async def weights_full(request: Request) -> dict:
        if tp > 1:  # refused before a byte of the weights is read
            raise RequestError(f"full-weight updates are not supported by a tensor-parallel engine (this server runs "
                               f"--tp {tp}): restart `trueflow serve` from a checkpoint holding the weights, or serve "
                               f"with --tp 1; LoRA updates (/weights/lora) are taken")
        state, _ = await weights_request(request, FullUpdate, FullByPath, True, root)

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
