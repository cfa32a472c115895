"""Each verdict acted on once: :class:`LivenessWatch` remembers the verdicts the controller was handed.

The coordinator judges its workers many times a second while a re-formation is pending (every rejoining
worker's call, every runner tick); a death is acted on once (until the worker calls again: then it is alive,
and a later death is new), a stuck member is stopped once per epoch, a silent rank is named once per step it
went quiet at, a slow one once per epoch. The runner keeps the watch for the job's life, so a restarted service
is not told twice either.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from meridian.service.runner.liveness.judge import Cause, Liveness, Verdict
from meridian.workers.contracts.events import StallSeen


def _key(v: Verdict) -> tuple | None:
    if v.liveness is Liveness.ALIVE:
        return None
    if v.liveness is Liveness.DEAD:
        return v.worker_id, Liveness.DEAD
    if v.cause is Cause.SILENT:
        return v.worker_id, Cause.SILENT, v.step
    return v.worker_id, v.cause, v.epoch


class LivenessWatch:
    def __init__(self) -> None:
        self.current: tuple[Verdict, ...] = ()
        """The latest judgement of every worker."""
        self._told: set[tuple] = set()
        self._lock = threading.Lock()

    def new(self, verdicts: Iterable[Verdict]) -> tuple[Verdict, ...]:
        """Record ``verdicts`` as the current judgement; those not handed on before."""
        verdicts = tuple(verdicts)
        with self._lock:
            self.current = verdicts
            fresh = []
            for v in verdicts:
                k = _key(v)
                if k is not None and k not in self._told:
                    self._told.add(k)
                    fresh.append(v)
            return tuple(fresh)

    def forget(self, worker_id: str) -> None:
        """``worker_id`` called again: its death, if it was judged dead, is no longer known."""
        with self._lock:
            self._told.discard((worker_id, Liveness.DEAD))

    def stalls(self) -> tuple[StallSeen, ...]:
        """The ranks that have stopped finishing steps, as judged last."""
        return tuple(v.stall for v in self.current if v.stall is not None)
