"""The agent's liveness port: a listening socket that lives exactly as long as the agent's process.

The coordinator connects to it when a member's collective partners report a failure (they rejoin) and that
member has not: a refused connection proves the member's process is gone, however long Ray takes to notice
its node's death (13 s with the default health checks of a ``ray start`` cluster). Nothing is read or
written: the connection is accepted and closed. The kernel answers for a dead process, so no thread of the
agent has to be scheduled for a "gone" answer to come fast.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading

PORTS = range(20000, 32768)
"""Where the port is picked: below the kernel's ephemeral range (32768 and up by default), where a rendezvous
port chosen by binding port 0 and closing it comes from. Bound with port 0 instead, an agent starting beside
a worker that has just picked its store port could be handed that very port, and rank 0's store would not
bind; above Ray's worker ports (10002-19999 by default)."""


def _bind(sock: socket.socket, host: str) -> None:
    for _ in range(100):
        try:
            sock.bind((host, random.choice(PORTS)))
            return
        except OSError:
            continue  # taken: another
    sock.bind((host, 0))


class LivenessListener:
    def __init__(self, host: str = "") -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _bind(self._sock, host)
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="meridian-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
