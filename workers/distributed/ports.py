"""Ports a worker listens on, picked below the kernel's ephemeral range.

A port picked by binding port 0 comes from the ephemeral range (32768 and up by default), the very range the
kernel hands to every outgoing connection: gloo's pair connections, Ray's RPCs, the store clients. Between
picking a port and binding it for real (a rendezvous store binds when its epoch forms, up to the join's grace
period later) any of those connections can take it, and on one host running four Ray nodes that happens:
rank 0's store failed to bind (``EADDRINUSE``), rank 0 rejoined, and its peers retried the dead address until
their collective timeout. Ports below the ephemeral range are only ever taken by an explicit bind.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

LOW_PORTS = range(20000, 32768)
"""Above Ray's worker ports (10002-19999 by default), below the ephemeral range."""


def on_low_port(bind: Callable[[int], T]) -> T:
    """``bind(port)`` on a free port of :data:`LOW_PORTS`: a port it cannot bind (taken: it raises ``OSError``,
    or torch's ``DistNetworkError``, a ``RuntimeError``) is followed by another; port 0 if a hundred tries found
    none. Returns what ``bind`` returned."""
    for _ in range(100):
        try:
            return bind(random.choice(LOW_PORTS))
        except (OSError, RuntimeError):
            continue  # taken: another
    return bind(0)


def bind_low(sock: socket.socket, host: str = "") -> int:
    """Bind ``sock`` to a free port of :data:`LOW_PORTS` (:func:`on_low_port`); its number."""

    def bind(port: int) -> int:
        sock.bind((host, port))
        return sock.getsockname()[1]

    return on_low_port(bind)


def free_port() -> int:
    """A port nothing listens on now, for a server that binds it a little later (the store of processes started
    together; an elastic rendezvous hosts its store from the join on instead)."""
    with socket.socket() as s:
        return bind_low(s)
