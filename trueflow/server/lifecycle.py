"""`trueflow serve`: the engine built once through the placement factory, served until SIGTERM or SIGINT, and shut
down without orphans."""

from __future__ import annotations

import asyncio
import os
import sys
import types
from typing import TYPE_CHECKING

from ..engine.interface import RolloutEngine
from ..http import server_config
from ..placement import EngineSpec, Placement, build_engine
from .app import create_app
from .limits import Limits
from .weights import TOKEN_ENV, weights_token
from .worker import STUCK_GRACE_S, Worker

if TYPE_CHECKING:
    from ..lora_files import LoraFile

SHUTDOWN_GRACE_S = 5.0  # after SIGTERM, how long requests have to answer before uvicorn cancels them


def end_engine(engine: RolloutEngine, worker: Worker) -> None:
    """Shut `engine` down once the worker has finished its running call (told to stop at its next step); where that
    call has not ended within STUCK_GRACE_S, the engine's processes are killed rather than asked to close."""
    worker.close()
    worker.join()
    worker.thread.join(STUCK_GRACE_S)
    if worker.thread.is_alive():
        for p in getattr(engine, "processes", ()):
            p.kill()
    engine.shutdown()


def serve(spec: EngineSpec, placement: Placement, host: str, port: int, limits: Limits = Limits(),
          default_seed: int | None = None, weights_root: str | None = None, lora: LoraFile | None = None,
          max_merged: int = 8) -> None:
    """Builds the engine once through the placement factory (with `placement.tp` > 1 a tensor-parallel engine, a
    process per rank, each with `spec.threads` intra-op threads), installs `lora` (a file `lora_files.find_lora`
    checked) through the engine interface as any LoRA update is, then serves it until SIGTERM or SIGINT: then it
    takes no more work, stops the running rollout at its next step, answers the waiting requests 503, ends the
    engine's processes and exits."""
    import uvicorn

    engine: RolloutEngine | None = None
    in_process = placement.kind == "local"
    token = weights_token(host)
    try:
        engine = build_engine(spec, placement)
        if lora is not None:
            from ..lora_files import load_lora

            checksum = engine.update_weights(load_lora(lora), lora.scale)
            print(f"trueflow serve: LoRA {lora.path} installed (rank {lora.rank}, scale {lora.scale:g}, checksum "
                  f"{checksum}); POST /weights/lora replaces it", file=sys.stderr, flush=True)
        # An engine in other processes runs `spec.threads`; an in-process one, whatever its worker thread has.
        app = create_app(engine, limits, default_seed, weights_root, None if in_process else spec.threads, token,
                         max_merged)
        if token is not None:  # a token of its own is printed; the user's, set in the environment, is not
            given = os.environ.get(TOKEN_ENV) == token
            print(f"trueflow serve: the /weights/* routes take the token {'in ' + TOKEN_ENV if given else token} "
                  f"(its clients, trueflow train too, send what {TOKEN_ENV} holds)", file=sys.stderr, flush=True)

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
                app.state.worker.close()  # uvicorn alone would wait for the running request, however long
                super().handle_exit(sig, frame)

            async def shutdown(self, sockets: list | None = None) -> None:
                await super().shutdown(sockets)
                if not in_process:  # now, not after `run`: uvicorn then re-raises the signal, which ends us at once
                    assert engine is not None  # built before the server
                    await asyncio.to_thread(end_engine, engine, app.state.worker)

        Server(server_config(app, host, port, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)).run()
    except KeyboardInterrupt:  # Ctrl-C while loading, or the SIGINT uvicorn re-raises once it has shut down
        pass
    finally:
        if engine is not None:  # a second shutdown does nothing
            engine.shutdown()
