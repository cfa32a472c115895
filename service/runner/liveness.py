"""Is a member's process still there? Evidence faster than Ray's node health check.

Each worker's agent listens on a port for as long as its process lives
(:mod:`meridian.workers.elastic.liveness`). When a member's peers rejoin after a failed collective and it has
not, the coordinator probes it: a refused connection means its process is gone (the kernel of a live host
answers for it at once); a connect that times out twice in a row means its host is unreachable. Either is
enough to re-form without it, on any cluster, before Ray declares its node dead. An answered connection means
it lives (it is restarting, or slow): it is waited for as usual, for a while. One that still answers but has
not rejoined long after its peers is stuck (in a collective, or forming a group, with a peer that already
left; gloo keeps it there for the whole collective timeout): the coordinator tells its agent to stop the
training process of that epoch (:func:`send_abort`), and the next one rejoins from its snapshots.
"""

from __future__ import annotations

import enum
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from meridian.workers.elastic.liveness import abort_message


class Probe(str, enum.Enum):
    ALIVE = "alive"
    GONE = "gone"  # connection refused: nothing listens there any more
    UNREACHABLE = "unreachable"  # no answer within the timeout (host down, or a partition)


def probe(address: str, port: int, timeout_s: float = 1.0) -> Probe:
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return Probe.ALIVE
    except ConnectionRefusedError:
        return Probe.GONE
    except OSError:
        return Probe.UNREACHABLE


def send_abort(address: str, port: int, epoch: int, timeout_s: float = 2.0) -> bool:
    """Tell the agent listening at ``address:port`` to stop its training process if it still trains in
    ``epoch``; ``True`` once the agent has acted on it."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as conn:
            conn.sendall(abort_message(epoch))
            return conn.recv(16).startswith(b"ok")
    except OSError:
        return False


UNREACHABLE_TIMES = 2
"""A member whose host did not answer this many probes in a row is treated as gone."""


@dataclass
class LivenessTracker:
    """Which suspected members are gone, from probes; ``probe_fn(address, port)`` is injectable for tests."""

    probe_fn: Callable[[str, int], Probe] = probe
    abort_fn: Callable[[str, int, int], bool] = send_abort
    gone: set[str] = field(default_factory=set)
    aborted: set[tuple[str, int]] = field(default_factory=set)
    """``(worker_id, epoch)`` pairs told to stop: each is told once."""
    _misses: dict[str, int] = field(default_factory=dict)
    _claims: threading.Lock = field(default_factory=threading.Lock)

    def check(self, suspects: Iterable[tuple[str, str, int]]) -> set[str]:
        """Probe each ``(worker_id, address, port)`` (a port of 0: the worker has none, it is never judged
        here) and return the worker ids newly found gone."""
        found: set[str] = set()
        for wid, address, port in suspects:
            if not port or wid in self.gone:
                continue
            result = self.probe_fn(address, port)
            if result is Probe.ALIVE:
                self._misses.pop(wid, None)
                continue
            self._misses[wid] = self._misses.get(wid, 0) + 1
            if result is Probe.GONE or self._misses[wid] >= UNREACHABLE_TIMES:
                found.add(wid)
        self.gone |= found
        return found

    def abort(self, stuck: Iterable[tuple[str, str, int]], epoch: int) -> set[str]:
        """Tell each ``(worker_id, address, port)`` not known gone and not told before to leave ``epoch``;
        the worker ids whose agent acted on it."""
        with self._claims:  # the coordinator probes from every rejoin's thread: one of them tells each worker
            told = [(wid, address, port) for wid, address, port in stuck
                    if port and wid not in self.gone and (wid, epoch) not in self.aborted]  # fmt: skip
            self.aborted |= {(wid, epoch) for wid, _, _ in told}
        return {wid for wid, address, port in told if self.abort_fn(address, port, epoch)}
