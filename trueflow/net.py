"""Addresses and ports: what every process group, store and server of a run binds to, one host's runs on loopback."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` now (for a process group's store, a rendezvous, a test server)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
