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

LOW_PORTS = range(20000, 32768)
"""Above Ray's worker ports (10002-19999 by default), below the ephemeral range."""


def bind_low(sock: socket.socket, host: str = "") -> int:
    """Bind ``sock`` to a free port of :data:`LOW_PORTS` (port 0 if a hundred tries found none); its number."""
    for _ in range(100):
        try:
            sock.bind((host, random.choice(LOW_PORTS)))
            return sock.getsockname()[1]
        except OSError:
            continue  # taken: another
    sock.bind((host, 0))
    return sock.getsockname()[1]


def free_port() -> int:
    """A port nothing listens on now, for a server that binds it a little later (a rendezvous store)."""
    with socket.socket() as s:
        return bind_low(s)
