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
    _probing: set[str] = field(default_factory=set)
    _claims: threading.Lock = field(default_factory=threading.Lock)

    def check(self, suspects: Iterable[tuple[str, str, int]]) -> set[str]:
        """Probe each ``(worker_id, address, port)`` (a port of 0: the worker has none, it is never judged
        here) and return the worker ids newly found gone.

        One probe of a worker at a time: every rejoining survivor's thread probes the silent member at the same
        moment, and two of their probes timing out together on one slow second counted as "twice in a row", so a
        live member was taken for gone. A worker whose probe is in flight is skipped; its result counts once."""
        found: set[str] = set()
        for wid, address, port in suspects:
            with self._claims:
                if not port or wid in self.gone or wid in self._probing:
                    continue
                self._probing.add(wid)
            try:
                result = self.probe_fn(address, port)
            finally:
                with self._claims:
                    self._probing.discard(wid)
            with self._claims:
                if result is Probe.ALIVE:
                    self._misses.pop(wid, None)
                    continue
                self._misses[wid] = self._misses.get(wid, 0) + 1
                if result is Probe.GONE or self._misses[wid] >= UNREACHABLE_TIMES:
                    found.add(wid)
                    self.gone.add(wid)
        return found

    def revive(self, worker_id: str) -> None:
        """``worker_id`` called the coordinator: it is alive, whatever was concluded before (a member taken for
        gone on a slow network, back as a newcomer, must be waited for and probed in later epochs again)."""
        with self._claims:
            self.gone.discard(worker_id)
            self._misses.pop(worker_id, None)

    def abort(self, stuck: Iterable[tuple[str, str, int]], epoch: int) -> set[str]:
        """Tell each ``(worker_id, address, port)`` not known gone and not told before to leave ``epoch``;
        the worker ids whose agent acted on it."""
        with self._claims:  # the coordinator probes from every rejoin's thread: one of them tells each worker
            told = [(wid, address, port) for wid, address, port in stuck
                    if port and wid not in self.gone and (wid, epoch) not in self.aborted]  # fmt: skip
            self.aborted |= {(wid, epoch) for wid, _, _ in told}
        return {wid for wid, address, port in told if self.abort_fn(address, port, epoch)}
