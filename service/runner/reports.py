"""What a job's workers and its runner report, kept until the service acknowledges it: step records and typed
events under one sequence (:class:`~meridian.service.runner.buffer.AckedBuffer`), folded on the way into the job's
Ray metrics and its ranks' placement. The runner's poll is built here, under the runner's lock.
Must never decide a job's status.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterable
from typing import Any

from meridian.service.runner.buffer import AckedBuffer
from meridian.service.runner.liveness.judge import Verdict
from meridian.service.runner.metrics import JobMetricsState, RayJobMetrics
from meridian.service.runner.placement import PlacedRank, PlacementTracker
from meridian.workers.contracts.events import EventKind, JobEvent
from meridian.workers.contracts.records import StepRecord

EXPORT_EVERY_S = 0.5
"""Step records push the job's Ray metrics at most this often (a job of 50 ms steps sent 20 exports a second;
Prometheus scrapes every few seconds)."""


class Reports:
    def __init__(self, job_id: str, lock: threading.Lock) -> None:
        self.lock = lock
        self.outbox = AckedBuffer()  # records and events until the service acknowledges them
        self.metrics = JobMetricsState(job_id)
        self.placement = PlacementTracker()
        self.placement_seq = 0
        """The outbox sequence number of the event that last changed :attr:`placement`."""
        self.result: dict[str, Any] | None = None
        self._records_epoch = 0
        """The epoch of the newest step record (0: none yet)."""
        self._last_recorded_step = 0
        self._exporter: RayJobMetrics | None = None
        self._exported_at = 0.0

    # -- what arrives (call with the lock held) ---------------------------------------------------------------
    def add_records(self, records: list[StepRecord]) -> None:
        for r in records:
            self._name_unrecorded_steps(r)
            if r.sync_decision is not None:  # an armed look-ahead decided, on the steps it measured
                self.add_event(EventKind.SYNC_DECIDED, f"Sync at epoch {r.epoch}: {r.sync_decision['reason']}.",
                               {**r.sync_decision, "epoch": r.epoch})
            self.outbox.add_record(r)
            self.metrics.on_record(r)
        if time.monotonic() - self._exported_at >= EXPORT_EVERY_S:  # the service's polls export too
            self.export()

    def add_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        """An event in its wire form (a worker's, the coordinator's), typed here against the registry."""
        self.add(JobEvent.parsed_or_malformed(kind, message, data or {}))

    def add(self, event: JobEvent) -> None:
        self.outbox.add_event(event)
        self.metrics.on_event(event)
        if self.placement.observe(event):
            self.placement_seq = self.outbox.seq

    def placement_since(self, after: int) -> tuple[PlacedRank, ...] | None:
        """The ranks' placement if it changed after cursor ``after`` (the event that changed it is after the cursor),
        else ``None``: the service stored it with that cursor already (N ranks in every poll cost the runner and
        the service an N-entry copy each second)."""
        return self.placement.ranks if self.placement_seq > after else None

    def add_heartbeats(self, beats: list[dict[str, Any]]) -> None:
        """Stamped with this actor's clock on arrival, the one the liveness judge compares with."""
        now = time.time()
        for beat in beats:
            self.metrics.on_heartbeat({**beat, "finished_at": beat.get("time"), "time": now})

    def _name_unrecorded_steps(self, r: StepRecord) -> None:
        """Rank 0 learns each step's loss a window of steps after the step (its sum over the ranks is read late:
        :mod:`meridian.workers.loop.report`). When an epoch breaks, the steps whose sums were still in flight were
        trained and their state kept, but no record of them will ever come. The new epoch's first record shows
        where it resumed: the steps between the last record and it are named in a ``steps_unrecorded`` event.
        (Read at that first record, not when the epoch forms: by then the old rank 0's last records, sent
        before it rejoined, have all arrived.)"""
        if self._records_epoch and r.epoch > self._records_epoch and r.step - 1 > self._last_recorded_step:
            first, last = self._last_recorded_step + 1, r.step - 1
            steps = f"step {first}" if first == last else f"steps {first}–{last}"
            self.add_event(EventKind.STEPS_UNRECORDED, f"{steps} trained and kept before epoch {r.epoch} formed "
                           f"{'has' if first == last else 'have'} no record: the loss was still being summed over "
                           "the ranks when the epoch broke",
                           {"from_step": first, "to_step": last, "epoch": r.epoch})  # fmt: skip
        self._records_epoch = max(self._records_epoch, r.epoch)
        self._last_recorded_step = max(self._last_recorded_step, r.step)

    # -- what the service collects (call with the lock held) ------------------------------------------------
    def observe(self, verdicts: Iterable[Verdict]) -> None:
        """Refresh the gauges (the live workers from the liveness judge's latest ``verdicts``) and export them."""
        self.metrics.refresh_live(verdicts)
        self.export()

    def export(self) -> None:
        self._exported_at = time.monotonic()
        try:
            if self._exporter is None:
                self._exporter = RayJobMetrics()
            self._exporter.export(self.metrics)
        except Exception:  # noqa: BLE001 - metrics must never break training or polling
            traceback.print_exc(limit=2)
