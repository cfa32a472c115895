"""The control loop: admit queued jobs, follow running ones, record what happens.

One :meth:`Supervisor.tick` reads the cluster once, admits what fits (FIFO by priority, no overtaking),
then polls every active job's runner from the cursor stored with the job, so the store always holds every
record exactly once even across service restarts. What a poll means is decided by the pure
:func:`~meridian.service.supervision.reconcile.reconcile`; this module only carries decisions out. Ray is
reached only through the ``launcher`` and the ``read_topology`` callable, so the loop is tested one tick at
a time against fakes. It must never branch on a status ``reason`` meant for people where a typed field
(``RunnerPoll.state``, ``JobRecord.cancel_requested``) says the same.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.errors import InvalidTransition
from meridian.service.jobs import JobRequest, JobState, JobStatus
from meridian.service.launcher import Launcher, build_train_config
from meridian.service.planning.figures import figures_for
from meridian.service.planning.plan import Plan
from meridian.service.planning.planner import admission, plan_job
from meridian.service.runner.poll import RunnerLost, RunnerPoll
from meridian.service.store import JobRecord, JobStore
from meridian.service.supervision.reconcile import Decision, needs_started_workers, reconcile
from meridian.service.supervision.stall import StallPolicy

log = logging.getLogger(__name__)

ACTIVE = {JobState.PLACING, JobState.RUNNING}
PROGRESS_EVENT_EVERY_S = 1.0


class Supervisor:
    def __init__(
        self, store: JobStore, launcher: Launcher, read_topology: Callable[[], ClusterTopology], *,
        checkpoint_root: str, poll_interval_s: float = 0.5,
        probe_report: Callable[[], dict[str, Any] | None] = lambda: None,
    ) -> None:
        self.store = store
        self.probe_report = probe_report
        self.launcher = launcher
        self.read_topology = read_topology
        self.checkpoint_root = checkpoint_root
        self.poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_tick_error: str = ""
        self._last_progress_event: dict[str, float] = {}
        self._followed: set[str] = set()  # jobs this instance launched or already reattached to
        self.stall_policy = StallPolicy()
        self._stalls_named: dict[str, set[tuple[int, int]]] = {}  # job → (rank, step) already in its events

    # -- API-facing actions -------------------------------------------------------------------------------
    def plan(self, request: JobRequest, topo: ClusterTopology | None = None) -> Plan:
        """The plan this request gets on the cluster now (raises if the cluster can never hold it)."""
        topo = topo or self.read_topology()
        figures, sources = figures_for(request, topo, self.probe_report())
        plan = plan_job(request, topo, figures)
        return replace(plan, explanation=f"{plan.explanation} Figures from: {', '.join(sources)}.")

    def submit(self, request: JobRequest, spec: dict[str, Any], *, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        plan = self.plan(request)  # reject what can never fit before anything is stored
        status = JobStatus(JobState.QUEUED, "Admitting", "waiting for the scheduler")
        record, created = self.store.create_job(request, spec, status=status, idempotency_key=idempotency_key)
        if created:
            self.store.update_fields(record.id, plan=plan.to_dict())
            self._wake.set()
        return self.store.get_job(record.id), created

    def cancel(self, job_id: str) -> JobRecord:
        job = self.store.get_job(job_id)
        if job.status.state.is_terminal:
            raise InvalidTransition(f"job {job_id} already {job.status.state.value}; nothing to cancel")
        if job.status.state is JobState.QUEUED:
            return self.store.set_status(job_id, JobStatus(JobState.CANCELLED, "Cancelled", "cancelled before it started"))
        self.launcher.cancel(job_id)
        # The flag is what the loop acts on; the reason only tells people.
        job = self.store.set_status(job_id, JobStatus(job.status.state, "Cancelling", "cancel requested; stopping the workers"),
                                    cancel_requested=True)
        self._wake.set()
        return job

    # -- the loop -----------------------------------------------------------------------------------------
    def tick(self) -> None:
        topo = self.read_topology()
        self._admit(topo)
        for job in self.store.list_jobs(states=ACTIVE, limit=10_000):
            self._follow(job)

    def _admit(self, topo: ClusterTopology) -> None:
        if self.store.list_jobs(states={JobState.PLACING}, limit=1):
            # Free resources only drop once the placing job's workers hold them; admitting another job
            # before that could promise the same CPUs twice.
            return
        for job in self.store.queued_in_order():
            try:
                plan = self.plan(job.request, topo)
            except Exception as e:  # noqa: BLE001 - the cluster shrank below what the job can ever use
                self._set(job.id, JobStatus(JobState.QUEUED, "Unschedulable", f"{e} (the job stays queued until the cluster can hold it)"))
                return
            wait = admission(plan, topo)
            if wait is not None:
                self._set(job.id, JobStatus(JobState.QUEUED, "WaitingForCapacity", wait))
                return  # FIFO: nothing overtakes the head of the queue
            self._launch(job, plan)
            return  # one admission per tick (see above)

    def _launch(self, job: JobRecord, plan: Plan) -> None:
        keep = job.request.checkpoint_every or job.request.keep_final
        ckpt_dir = os.path.join(self.checkpoint_root, job.id) if keep else ""
        config = build_train_config(job.id, job.request, plan, ckpt_dir)
        self.store.update_fields(job.id, plan=plan.to_dict())
        where = ", ".join(f"{plan.workers_in(dc)} in {dc}" for dc in plan.datacenters)
        self._set(job.id, JobStatus(JobState.PLACING, "Placing", f"starting {plan.num_workers} workers ({where})"))
        try:
            runner = self.launcher.launch(job.id, config, plan, min_workers=job.request.topology.min_workers)
        except Exception as e:  # noqa: BLE001 - report any launch failure on the job
            self._set(job.id, JobStatus(JobState.FAILED, "LaunchFailed", f"could not start the job on Ray: {e}"))
            return
        self.store.update_fields(job.id, runner=runner)
        self._followed.add(job.id)

    def _follow(self, job: JobRecord) -> None:
        cursor = int((job.progress or {}).get("cursor", 0))
        try:
            poll: RunnerPoll | RunnerLost = self.launcher.poll(job.id, cursor)
        except RunnerLost as lost:
            poll = lost
        except Exception as e:  # noqa: BLE001 - a slow poll is retried next tick
            log.warning("polling job %s failed: %s", job.id, e)
            return
        started = self._started_workers(job.id) if isinstance(poll, RunnerPoll) and needs_started_workers(poll) else {}
        decision = reconcile(
            job, poll, now=time.time(), first_sight=job.id not in self._followed, started=started,
            progress_due=time.monotonic() - self._last_progress_event.get(job.id, -1e9) >= PROGRESS_EVENT_EVERY_S,
            stalls_named=self._stalls_named.get(job.id, set()), stall_policy=self.stall_policy,
        )
        self._carry_out(job.id, decision)

    def _carry_out(self, job_id: str, d: Decision) -> None:
        """Do what :func:`reconcile` decided, in its order (see :class:`Decision`)."""
        if d.resume:
            try:
                self.launcher.resume(job_id)
            except Exception as e:  # noqa: BLE001 - retried next tick, like a slow poll
                log.warning("resuming the runner of job %s failed: %s", job_id, e)
                return
        if d.store:
            self._followed.add(job_id)
        named = self._stalls_named.setdefault(job_id, set())
        for stall in d.stalls:
            named.add((stall.rank, stall.step))
            self.store.add_event(job_id, "stall", stall.message(), stall.to_dict(), at=d.observed_at)
        if d.emits_progress:
            self._last_progress_event[job_id] = time.monotonic()
        if d.status is not None:
            self._set(job_id, d.status)
        if d.store:
            # The store and the API speak JSON: records become dicts here and nowhere earlier.
            self.store.record_poll(job_id, records=[r.to_dict() for r in d.records],
                                   events=[dict(ev) for ev in d.events], **d.fields)
        if d.outcome is not None:
            self._set(job_id, d.outcome)
        if d.release:
            self.launcher.release(job_id)
        if d.forget:
            self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        self._followed.discard(job_id)
        self._last_progress_event.pop(job_id, None)
        self._stalls_named.pop(job_id, None)

    def _started_workers(self, job_id: str) -> dict[str, dict[str, Any]]:
        """What each worker of the job said when it started (host, pid, device), by worker id."""
        return {e.data.get("worker_id"): e.data for e in self.store.list_events(job_id, limit=100_000)
                if e.kind == "worker_started"}

    def _set(self, job_id: str, status: JobStatus) -> None:
        try:
            self.store.set_status(job_id, status)
        except InvalidTransition as e:  # e.g. a cancel raced a finish: the first terminal state wins
            log.info("job %s: %s", job_id, e)

    # -- thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="meridian-supervisor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.last_tick_error = ""
            except Exception as e:  # noqa: BLE001 - the loop must survive a bad tick
                self.last_tick_error = f"{type(e).__name__}: {e}"
                log.exception("supervisor tick failed")
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

