"""Is a member's process still there? Evidence faster than Ray's node health check.

Each worker's agent listens on a port for as long as its process lives
(:mod:`meridian.workers.elastic.liveness`). When a member's peers rejoin after a failed collective and it has
not, the coordinator probes it: a refused connection means its process is gone (the kernel of a live host
answers for it at once); a connect that times out twice in a row means its host is unreachable. Either is
enough to re-form without it, on any cluster, before Ray declares its node dead. An answered connection means
it lives (it is restarting, or slow): it is waited for as usual.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


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


UNREACHABLE_TIMES = 2
"""A member whose host did not answer this many probes in a row is treated as gone."""


@dataclass
class LivenessTracker:
    """Which suspected members are gone, from probes; ``probe_fn(address, port)`` is injectable for tests."""

    probe_fn: Callable[[str, int], Probe] = probe
    gone: set[str] = field(default_factory=set)
    _misses: dict[str, int] = field(default_factory=dict)

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
