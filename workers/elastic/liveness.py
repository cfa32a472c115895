"""The agent's liveness port: a listening socket that lives exactly as long as the agent's process.

The coordinator connects to it when a member's collective partners report a failure (they rejoin) and that
member has not: a refused connection proves the member's process is gone, however long Ray takes to notice
its node's death (13 s with the default health checks of a ``ray start`` cluster). A probe writes nothing:
the connection is accepted and closed. The kernel answers for a dead process, so no thread of the agent has
to be scheduled for a "gone" answer to come fast.

The same port carries the one order the coordinator gives an agent directly: ``abort <epoch>``. A member
that answers but has not rejoined long after its peers is stuck, typically in a collective (or in forming the
epoch's group) with a peer that already left, and gloo would keep it there for the whole collective timeout.
The agent stops its training process if it still trains in that epoch (:class:`~meridian.workers.elastic.agent.Agent`);
the next one rejoins at once from the snapshots the stopped one left.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from meridian.workers.distributed.ports import bind_low

ABORT = b"abort"
"""``abort <epoch>\\n``: stop the training process if it still trains in ``epoch``."""
READ_TIMEOUT_S = 2.0
"""How long a connection may take to say what it wants; a probe closes at once."""


def abort_message(epoch: int) -> bytes:
    return ABORT + b" %d\n" % epoch


def parse_abort(message: bytes) -> int | None:
    """The epoch an ``abort`` message names, or ``None`` for anything else (a probe sends nothing)."""
    words = message.split()
    if len(words) == 2 and words[0] == ABORT and words[1].isdigit():
        return int(words[1])
    return None


class LivenessListener:
    def __init__(self, host: str = "", on_abort: Callable[[int], None] | None = None) -> None:
        self.on_abort = on_abort
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        bind_low(self._sock, host)  # (:mod:`meridian.workers.distributed.ports`: why not port 0)
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
            with contextlib.suppress(OSError), conn:
                conn.settimeout(READ_TIMEOUT_S)
                epoch = parse_abort(conn.recv(64))
                if epoch is not None and self.on_abort is not None:
                    self.on_abort(epoch)
                    conn.sendall(b"ok\n")

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
