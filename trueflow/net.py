"""Addresses and ports: what every process group, store and server of a run binds to, one host's runs on loopback.

torch's TCPStore server listens on every interface (`*`) whatever host it is given, and so would the rendezvous of
every one-host run (a one-rank `train`, the TP ranks, a Ray run's trainers). `tcp_store` hosts it on a socket
bound to the rendezvous address alone (torch's `master_listen_fd`); `keep_sockets_on` points gloo's and NCCL's own
sockets at the loopback interface when that address is loopback. A multi-node run names a routable rendezvous
address (`MASTER_ADDR`, `--ray-address`), and its stores bind that address only (docs/scaling.md).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

LOOPBACK = "127.0.0.1"
STORE_TIMEOUT = timedelta(minutes=5)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` now (for a process group's store, a rendezvous, a test server)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine only."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_interface() -> str:
    """The name of the loopback network interface (Linux `lo`, macOS `lo0`)."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def keep_sockets_on(host: str) -> None:
    """For a rendezvous on loopback, gloo's and NCCL's sockets on the loopback interface too (each picks an
    interface of its own otherwise: the one the hostname resolves to); a setting the user made is kept."""
    if is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())


def tcp_store(host: str, port: int, rank: int, world: int, timeout: timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """A process group's rendezvous store at host:port: rank 0 hosts it on a socket bound to `host` alone (port 0:
    one the OS picks), the other ranks connect to it."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store's server takes the socket over (it stays open as long as the store may serve).
    return dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())
