"""The runner's outbox: per-step records and events under one increasing sequence, kept until the service
acknowledges them.

The cursor the supervisor passes to ``poll(after)`` is the one stored with the job *after* the records up
to it were committed (:meth:`~meridian.service.store.JobStore.record_poll`), so it is the acknowledgement:
everything at or below it is trimmed, nothing above it is. Only if the service does not collect for so long
that more than :data:`MAX_UNACKED` entries wait (memory of the runner is finite) are the oldest dropped, and
the next poll starts with a ``gap`` event that says which sequence numbers were lost: never silently.

Pure Python, no Ray: tested directly (tests/test_runner_buffer.py). The caller holds the runner's lock.
"""

from __future__ import annotations

import time
from collections import deque

from meridian.workers.contracts.events import EventKind, Gap, JobEvent
from meridian.workers.contracts.records import StepRecord

MAX_UNACKED = 200_000
"""Entries kept for a service that does not poll (a 1 s step with 64 ranks' events: over an hour)."""


class AckedBuffer:
    def __init__(self, max_unacked: int = MAX_UNACKED) -> None:
        self.max_unacked = max_unacked
        self.seq = 0
        self._records: deque[tuple[int, StepRecord]] = deque()
        self._events: deque[tuple[int, JobEvent]] = deque()
        self.dropped_through = 0
        """Every entry with a sequence number up to this one that was not acknowledged is lost."""

    def add_record(self, record: StepRecord) -> None:
        self.seq += 1
        self._records.append((self.seq, record))
        self._bound()

    def add_event(self, event: JobEvent) -> None:
        self.seq += 1
        self._events.append((self.seq, event))
        self._bound()

    def __len__(self) -> int:
        return len(self._records) + len(self._events)

    def since(self, after: int) -> tuple[tuple[StepRecord, ...], tuple[JobEvent, ...]]:
        """Acknowledge everything up to ``after`` (trim it) and return what follows, oldest first; a
        ``gap`` event leads the events if some of what follows ``after`` was dropped unacknowledged."""
        for q in (self._records, self._events):
            while q and q[0][0] <= after:
                q.popleft()
        events = tuple(e for _, e in self._events)
        if self.dropped_through > after:
            lost = self.dropped_through - after
            gap = JobEvent(kind=EventKind.GAP, time=time.time(),
                           message=f"{lost} record(s)/event(s) after cursor {after} were dropped by the runner: the "
                                   f"service did not collect them before {self.max_unacked} were waiting",
                           payload=Gap(after=after, through=self.dropped_through, lost=lost))
            events = (gap, *events)
        return tuple(r for _, r in self._records), events

    def _bound(self) -> None:
        while len(self) > self.max_unacked:
            r, e = self._records, self._events
            q = r if r and (not e or r[0][0] < e[0][0]) else e
            self.dropped_through = max(self.dropped_through, q.popleft()[0])
