"""Plumbing shared by trueflow's HTTP servers (the reward server, the engine server): their uvicorn config, with
header and body read deadlines, and a server in a thread."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

MSGPACK = "application/msgpack"
# A request's headers must arrive within HEADER_TIMEOUT_S of its first byte (or of the connection's opening), its
# body within BODY_TIMEOUT_S of its headers, or the connection is dropped: a client that drips bytes (slow loris)
# cannot hold connections open. uvicorn has no such deadline of its own: `timeout_keep_alive` bounds the idle time
# between a response and the next request only, and is cancelled by the next request's first byte.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0


class BodyTooLarge(ValueError):
    """A request body past its endpoint's byte limit (the servers answer 413)."""


async def read_body(request: Any, limit: int) -> bytes:
    """A Starlette request's body, refused with BodyTooLarge past `limit` bytes: by its Content-Length before any of
    it is read, else as soon as the bytes streamed in pass the limit (a chunked body declares no length)."""
    too_big = BodyTooLarge(f"the body is larger than the {limit} bytes this endpoint takes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


@functools.cache
def timed_protocol(header_timeout: float = HEADER_TIMEOUT_S, body_timeout: float = BODY_TIMEOUT_S) -> type:
    """uvicorn's h11 protocol with the two deadlines above (uvicorn takes a protocol class as its `http`)."""
    import asyncio

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._deadline: asyncio.TimerHandle | None = None
            self._waiting_for: str | None = None
            super().connection_made(transport)
            self._arm("headers")

        def _arm(self, what: str) -> None:
            self._cancel()
            timeout = header_timeout if what == "headers" else body_timeout
            self._deadline, self._waiting_for = self.loop.call_later(timeout, self._expired, what, timeout), what

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._waiting_for = None, None

        def _expired(self, what: str, timeout: float) -> None:
            self._deadline = self._waiting_for = None
            if not self.transport.is_closing():
                client = "{}:{}".format(*self.client) if self.client else "a client"
                self.logger.warning("%s: connection dropped, its request's %s did not arrive within %g s", client,
                                    what, timeout)
                self.transport.close()

        def _watch(self) -> None:
            """Arm, move or drop the deadline by where the client's side of the request now stands."""
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                if self._waiting_for != "body":
                    self._arm("body")
            elif state is not h11.IDLE:  # the request is in (or the connection is over)
                self._cancel()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self.conn.their_state is h11.IDLE:  # a kept-alive connection's next request
                self._arm("headers")
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start the next cycle and read a pipelined request
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            super().connection_lost(exc)

    return TimedH11Protocol


def server_config(app, host: str, port: int, log_level: str = "info", header_timeout: float = HEADER_TIMEOUT_S,
                  body_timeout: float = BODY_TIMEOUT_S, **options: Any):
    """The uvicorn config of every trueflow server: `app` on host:port, HTTP/1.1 by h11 with the read deadlines."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=timed_protocol(header_timeout, body_timeout), **options)


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0,
                    header_timeout: float = HEADER_TIMEOUT_S, body_timeout: float = BODY_TIMEOUT_S) -> Iterator[str]:
    """Serve an ASGI app with uvicorn from a daemon thread of this process (a trainer embedding a server, or a
    test); yields the base URL once it accepts connections and stops it on exit. Port 0: the OS picks a free one."""
    import uvicorn

    # On exit, requests still open after `timeout` are cancelled, so a stuck one cannot keep the thread alive.
    server = uvicorn.Server(server_config(app, host, port, "warning", header_timeout, body_timeout,
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
