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

And the job runner's request for a profiler trace, ``profile <id> <steps>``: the agent hands it to its training
process (:mod:`meridian.workers.elastic.profiling`), which records the next ``steps`` steps. Told once, over this
port: no step pays a Ray call or a round trip for it.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable

from meridian.workers.distributed.ports import bind_low

ABORT = b"abort"
"""``abort <epoch>\\n``: stop the training process if it still trains in ``epoch``."""
READ_TIMEOUT_S = 2.0
"""How long a connection may take to say what it wants; a probe closes at once."""


PROFILE = b"profile"
"""``profile <id> <steps>\n``: record a profiler trace of the next ``steps`` steps, named ``id``."""
PROFILE_ID = re.compile(rb"^[0-9a-f]{1,32}$")
MAX_PROFILE_STEPS = 1000


def abort_message(epoch: int) -> bytes:
    return ABORT + b" %d\n" % epoch


def profile_message(request_id: str, steps: int) -> bytes:
    return b"%s %s %d\n" % (PROFILE, request_id.encode(), steps)


def parse_profile(message: bytes) -> tuple[str, int] | None:
    """``(id, steps)`` of a ``profile`` message, or ``None`` for anything else (an id of hex digits, 1 to
    :data:`MAX_PROFILE_STEPS` steps: nothing a connection sends becomes a path or a long capture)."""
    words = message.split()
    if (len(words) == 3 and words[0] == PROFILE and PROFILE_ID.match(words[1]) and words[2].isdigit()
            and 1 <= int(words[2]) <= MAX_PROFILE_STEPS):
        return words[1].decode(), int(words[2])
    return None


def parse_abort(message: bytes) -> int | None:
    """The epoch an ``abort`` message names, or ``None`` for anything else (a probe sends nothing)."""
    words = message.split()
    if len(words) == 2 and words[0] == ABORT and words[1].isdigit():
        return int(words[1])
    return None


class LivenessListener:
    def __init__(self, host: str = "", on_abort: Callable[[int], None] | None = None,
                 on_profile: Callable[[str, int], None] | None = None) -> None:
        self.on_abort = on_abort
        self.on_profile = on_profile
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
                message = conn.recv(128)
                epoch = parse_abort(message)
                if epoch is not None and self.on_abort is not None:
                    self.on_abort(epoch)
                    conn.sendall(b"ok\n")
                profile = parse_profile(message)
                if profile is not None and self.on_profile is not None:
                    self.on_profile(*profile)
                    conn.sendall(b"ok\n")

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
