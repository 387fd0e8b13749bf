"""Both HTTP servers drop a slow-loris client (docs/server.md, "Trust"): a connection that sends nothing, drips its
headers, or drips its body past the deadline is closed by the server, while a client that keeps to them — also on
a kept-alive connection — is answered; `trueflow serve` and `trueflow reward-serve` run with the deadlines."""

from __future__ import annotations

import socket
import time

import pytest
import uvicorn

from trueflow import http
from trueflow.engine.engine import Engine
from trueflow.http import serve_in_thread, timed_protocol
from trueflow.rewards import server as reward_server
from trueflow.rewards.base import build_reward
from trueflow.server import create_app

DEADLINE_S = 0.6


@pytest.fixture(scope="module", params=["engine", "reward"])
def server(request, tiny_checkpoint):
    """(host, port, a GET path) of each server, with short read deadlines."""
    if request.param == "engine":
        app, path = create_app(Engine(tiny_checkpoint)), "/health"
    else:
        app, path = reward_server.create_app(build_reward("redness", None, "cpu")), "/info"
    with serve_in_thread(app, header_timeout=DEADLINE_S, body_timeout=DEADLINE_S) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port), path


def closed_after(sock: socket.socket, drip: bytes = b"", every: float = 0.1, limit: float = 10.0) -> float:
    """Send `drip` a byte every `every` s (then nothing) until the server closes the connection; the seconds that
    took (the test fails past `limit`)."""
    start = time.monotonic()
    sock.settimeout(every)
    for i in range(int(limit / every)):
        if i < len(drip):
            try:
                sock.sendall(drip[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
    pytest.fail(f"the server kept the connection open for {limit} s")


def request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def test_a_silent_or_dripping_client_is_dropped(server):
    host, port, path = server
    with socket.create_connection((host, port)) as s:  # never sends a byte
        assert closed_after(s) < DEADLINE_S + 1.5
    with socket.create_connection((host, port)) as s:  # headers a byte every 0.1 s: 30 bytes need 3 s
        assert closed_after(s, request(path) * 2) < DEADLINE_S + 1.5
    body = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\nContent-Length: 100\r\n\r\n"
    with socket.create_connection((host, port)) as s:  # headers at once, then the body a byte every 0.1 s
        s.sendall(body)
        assert closed_after(s, b"x" * 100) < DEADLINE_S + 1.5


def test_a_client_that_keeps_to_the_deadlines_is_answered(server):
    host, port, path = server
    with socket.create_connection((host, port), timeout=30) as s:
        for _ in range(2):  # the second request on the kept-alive connection, after a pause
            s.sendall(request(path))
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += s.recv(65536)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += s.recv(65536)
            time.sleep(DEADLINE_S / 2)


def test_both_verbs_serve_with_the_deadlines(tiny_checkpoint, monkeypatch):
    """`trueflow serve` and `trueflow reward-serve` hand uvicorn the timed protocol with the default deadlines."""
    configs = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: configs.append(self.config))
    reward_server.serve("redness", port=0)
    from trueflow.placement import EngineSpec, Placement
    from trueflow.server import serve

    serve(EngineSpec(str(tiny_checkpoint), threads=1), Placement("local"), "127.0.0.1", 0)
    assert [c.http for c in configs] == [timed_protocol(http.HEADER_TIMEOUT_S, http.BODY_TIMEOUT_S)] * 2
