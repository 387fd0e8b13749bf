"""Plumbing shared by trueflow's HTTP servers (the reward server, the engine server)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

MSGPACK = "application/msgpack"


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> Iterator[str]:
    """Serve an ASGI app with uvicorn from a daemon thread of this process (a trainer embedding a server, or a
    test); yields the base URL once it accepts connections and stops it on exit. Port 0: the OS picks a free one."""
    import uvicorn

    # On exit, requests still open after `timeout` are cancelled, so a stuck one cannot keep the thread alive.
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=timeout))
    thread = threading.Thread(target=server.run, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {host}:{port} within {timeout:g} s")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
