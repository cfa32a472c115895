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
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.data_access import DataAccess
from meridian.service.errors import InvalidJob, InvalidTransition
from meridian.service.jobs import JobRequest, JobState, JobStatus
from meridian.service.launcher import Launcher
from meridian.service.lease import Lease, LeaseLost
from meridian.service.planning.figures import figures_for
from meridian.service.planning.placement import admission
from meridian.service.planning.plan import Plan
from meridian.service.planning.planner import plan_job
from meridian.service.quotas import Held, Quota, over_quota
from meridian.service.resolved import ResolvedJob, resolve
from meridian.service.resume_source import find_checkpoint
from meridian.service.runner.poll import RunnerLost, RunnerPoll
from meridian.service.store import JobRecord, JobStore, new_job_id, request_hash
from meridian.service.supervision.preemption import Running, victims
from meridian.service.supervision.reconcile import (
    DEFAULT_DEADLINES,
    DEFAULT_MAX_RELAUNCHES,
    PREEMPTED,
    Deadlines,
    Decision,
    reconcile,
    unanswered,
)
from meridian.workers.contracts.events import ErrorText, EventKind, JobEvent, Preempted

log = logging.getLogger(__name__)

ACTIVE = {JobState.PLACING, JobState.RUNNING}
BUILTIN_DATA_ONLY = DataAccess()
PROGRESS_EVENT_EVERY_S = 1.0
QUOTA_EXCEEDED = "QuotaExceeded"
RELEASED_WORKERS_GONE_S = 10.0
"""A killed runner's workers die with it, but not at once (Ray ends the actors it owned): the sweep of their
snapshot folders waits this long, so that no worker still writing leaves a folder behind."""


def _suspendable(job: JobRecord) -> bool:
    """Whether a running job can be suspended and resume where it stopped: it keeps durable checkpoints, is
    data-parallel only (an epoch of tensor/pipeline parallelism has no step boundary to leave at), and its ranks
    are all placed (their nodes are what its suspension frees)."""
    r = job.resolved
    return (r is not None and bool(r.config.checkpoint_dir) and r.config.parallel.model_parallel == 1
            and job.status.state is JobState.RUNNING and not job.cancel_requested
            and len(job.placement or ()) == r.plan.num_workers)


class Supervisor:
    def __init__(
        self, store: JobStore, launcher: Launcher, read_topology: Callable[[], ClusterTopology], *,
        checkpoint_root: str, poll_interval_s: float = 0.5,
        probe_report: Callable[[], dict[str, Any] | None] = lambda: None, deadlines: Deadlines = DEFAULT_DEADLINES,
        data_access: DataAccess = BUILTIN_DATA_ONLY, lease: Lease | None = None,
        gpu_memory: Callable[[ClusterTopology], dict[str, int]] = lambda topo: {},
        storage_check: Callable[[tuple[str, ...], ClusterTopology], None] = lambda dcs, topo: None,
        max_relaunches: int = DEFAULT_MAX_RELAUNCHES,
    ) -> None:
        self.store = store
        self.max_relaunches = max_relaunches
        """Times a job whose runner actor is lost is queued again (from its checkpoint) before it fails."""
        self.probe_report = probe_report
        self.gpu_memory = gpu_memory
        """node id → its GPUs' memory read on the node (:class:`~meridian.service.cluster.gpu_memory.NodeGpuMemory`)."""
        self.launcher = launcher
        self.storage_check = storage_check
        """Raises when the jobs' storage is not shared by the nodes of these datacenters (and the service)
        (:class:`~meridian.service.cluster.storage_proof.SharedStorage`)."""
        self.read_topology = read_topology
        self.checkpoint_root = checkpoint_root
        self.poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.deadlines = deadlines
        self.data_access = data_access
        self.lease = lease  # held on the database; renewed every tick, nothing is done without it
        self.last_tick_error: str = ""
        self.last_tick_at: float | None = None  # monotonic time of the last tick that completed
        self.job_errors: dict[str, str] = {}  # job → why following it failed on the last tick (for /healthz)
        self._last_progress_event: dict[str, float] = {}
        self._followed: set[str] = set()  # jobs this instance launched or already reattached to

    # -- API-facing actions -------------------------------------------------------------------------------
    def plan(self, request: JobRequest, topo: ClusterTopology | None = None) -> Plan:
        """The plan this request gets on the cluster now (raises if the cluster can never hold it)."""
        topo = topo or self.read_topology()
        figures, sources = figures_for(request, topo, self.probe_report(), self.gpu_memory(topo))
        plan = plan_job(request, topo, figures)
        return replace(plan, explanation=f"{plan.explanation} Figures from: {', '.join(sources)}.")

    def resolve(self, request: JobRequest, job_id: str, topo: ClusterTopology | None = None) -> ResolvedJob:
        """What ``request`` would run as job ``job_id`` on the cluster now: its plan and training config (raises
        :class:`Unschedulable` if the cluster can never hold it, :class:`InvalidJob` if the plan makes an option
        invalid)."""
        resume = None if request.resume_from is None else find_checkpoint(
            request.resume_from, owner=request.owner, get_job=self.store.get_job, access=self.data_access)
        return resolve(job_id, request, self.plan(request, topo), checkpoint_root=self.checkpoint_root, resume=resume)

    def submit(self, request: JobRequest, spec: dict[str, Any], *, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """Admit the data, plan the job and build its training config, then store it queued: the one time a job
        is planned and validated (anything that would fail at launch raises here, a 422 or 409 before the job is
        stored). Admission later checks only whether the stored plan fits in the free capacity."""
        body_hash = request_hash(spec)
        if idempotency_key:
            # A retry returns the job it created even if the cluster changed since (no re-planning), and
            # a different body under the same key is refused (IdempotencyConflict).
            existing = self.store.find_by_idempotency_key(request.owner, idempotency_key, body_hash)
            if existing is not None:
                return existing, False
        request = self.data_access.admit(request)  # a data source the service may not read is a 422
        job_id = new_job_id()
        topo = self.read_topology()
        resolved = self.resolve(request, job_id, topo)  # reject what can never fit or never run before anything is stored
        self.storage_check(resolved.plan.datacenters, topo)  # and a job whose nodes do not share the storage (a 409)
        status = JobStatus(JobState.QUEUED, "Admitting", "waiting for the scheduler")
        record, created = self.store.create_job(request, spec, status=status, idempotency_key=idempotency_key,
                                                request_hash=body_hash, resolved=resolved, job_id=job_id)
        if created:
            self._wake.set()
        return self.store.get_job(record.id), created

    def cancel(self, job_id: str) -> JobRecord:
        """Cancel a job: a queued one at once; an active one by a stored flag that the loop acts on each tick
        until the runner stops (or the cancel deadline passes and the runner is killed). Every write is a
        compare-and-set, so a cancel racing an admission either wins (the job is never launched) or is
        stored on the placing job (whose runner is told to stop as soon as it exists)."""
        for _ in range(3):
            job = self.store.get_job(job_id)
            if job.status.state.is_terminal:
                raise InvalidTransition(f"job {job_id} already {job.status.state.value}; nothing to cancel")
            try:
                if job.status.state is JobState.QUEUED:
                    return self.store.set_status(job_id, JobStatus(JobState.CANCELLED, "Cancelled", "cancelled before it started"),
                                                 expect={JobState.QUEUED})
                # The flag is what the loop acts on; the reason only tells people.
                job = self.store.set_status(
                    job_id, JobStatus(job.status.state, "Cancelling", "cancel requested; stopping the workers"),
                    expect={job.status.state}, cancel_requested=True)
            except InvalidTransition:
                continue  # the supervisor moved the job meanwhile (e.g. admitted it): decide again
            self.launcher.cancel(job_id)  # a runner not started yet is told on the next tick
            self._wake.set()
            return job
        raise InvalidTransition(f"job {job_id} kept changing state; try the cancel again")

    def set_quota(self, quota: Quota) -> Quota:
        """Store an owner's quota; the queue is looked at again at once (a raised quota admits its jobs)."""
        self.store.set_quota(quota)
        self._wake.set()
        return quota

    # -- the loop -----------------------------------------------------------------------------------------
    def tick(self) -> None:
        self._check_lease()
        topo = self.read_topology()
        admit_error: Exception | None = None
        try:
            self._admit(topo)
        except LeaseLost:
            raise
        except Exception as e:  # noqa: BLE001 - raised below, once the active jobs were followed
            admit_error = e
        self._follow_active()
        if admit_error is not None:
            raise admit_error  # the tick failed (/healthz says so), but the running jobs were still followed

    def _follow_active(self) -> None:
        for job in self.store.list_jobs(states=ACTIVE, limit=10_000):
            if self._stop.is_set():
                return  # the service is stopping: its store may close under this loop
            try:
                self._follow(job)
            except LeaseLost:
                raise
            except Exception as e:  # noqa: BLE001 - one job's failure must not stop the others being followed
                self._job_failed(job.id, e)
            else:
                self.job_errors.pop(job.id, None)

    def _check_lease(self) -> None:
        """Raise :class:`LeaseLost` if another service took this database's lease. Asked before every write
        that follows a Ray call, not only once a tick: a tick can outlast the lease (a launch waits up to a
        minute, each poll up to ten seconds), and a service that took over meanwhile has already stored what this
        one is about to (the records since a cursor read before the takeover would be stored twice). Cheap: the
        database is asked only once a third of the lease's life has passed since the last renewal."""
        if self.lease is not None and not self.lease.renew():
            raise LeaseLost("another service took over this database's lease; this one no longer admits or "
                            "follows jobs (stop it, or restart it once the other service has stopped)")

    def _job_failed(self, job_id: str, e: Exception) -> None:
        """Record on the job (once per distinct error) that following it failed; the tick goes on."""
        message = f"{type(e).__name__}: {e}"[:500]
        if self.job_errors.get(job_id) == message:  # the same as last tick (a runner that stays unreachable)
            log.debug("following job %s failed again: %s", job_id, message)
            return
        log.exception("following job %s failed", job_id)
        self.job_errors[job_id] = message
        try:
            self.store.add_event(job_id, JobEvent(
                kind=EventKind.SUPERVISOR_ERROR, payload=ErrorText(error=message),
                message=f"the service could not follow this job on its last tick ({message}); it retries every tick"))
        except Exception:  # noqa: BLE001 - the store itself failing is reported by /healthz
            log.exception("recording the error of job %s failed", job_id)

    def _admit(self, topo: ClusterTopology) -> None:
        placing = self.store.list_jobs(states={JobState.PLACING}, limit=1)
        if placing:
            # Free resources only drop once the placing job's workers hold them; admitting another job
            # before that could promise the same CPUs twice. The placing deadline bounds this wait.
            why = (f"waiting for job {placing[0].id} to finish placing its workers (placing fails after "
                   f"{self.deadlines.placing_s:.0f} s)")
            for job in self.store.queued_in_order():
                # A job held by its owner's quota keeps saying so: that, not the placement, is what it waits for;
                # a preempted one keeps saying where it resumes from.
                if job.status.message != why and job.status.reason not in (QUOTA_EXCEEDED, PREEMPTED):
                    self._set(job.id, JobStatus(JobState.QUEUED, "WaitingForPlacement", why), expect={JobState.QUEUED})
            return
        quotas = self.store.quotas()
        held: dict[str, list[Held]] = {}
        for active in self.store.list_jobs(states=ACTIVE, limit=10_000):
            if active.resolved is not None:
                held.setdefault(active.owner, []).append(Held.of(active.resolved.plan))
        for job in self.store.queued_in_order():
            resolved = self._resolved(job, topo)
            if resolved is None:
                continue  # failed: it cannot run at all
            over = over_quota(quotas.get(job.owner), held.get(job.owner, ()), Held.of(resolved.plan))
            if over is not None:
                # The owner's limit, not the cluster's: other owners' jobs behind it are not held back.
                self._set(job.id, JobStatus(JobState.QUEUED, QUOTA_EXCEEDED, over), expect={JobState.QUEUED})
                continue
            never = admission(resolved.plan, topo.with_everything_free())
            if never is not None:
                # Not a capacity wait: the cluster as it is cannot hold this job's plan even when idle (a node or
                # datacenter it was planned on is gone), so jobs behind it that fit are not held back by it (FIFO
                # holds among jobs waiting for capacity).
                self._set(job.id, JobStatus(JobState.QUEUED, "Unschedulable",
                                            f"the cluster cannot hold the plan this job was given at submit: {never} "
                                            "(it stays queued until the cluster can hold it, and jobs behind it "
                                            "that fit are admitted meanwhile; cancel and resubmit it to plan it "
                                            "for the cluster as it is now)"), expect={JobState.QUEUED})
                continue
            wait = admission(resolved.plan, topo)
            if wait is not None:
                wait += self._preempt_for(job, resolved.plan, topo)
                if job.status.reason != PREEMPTED:  # (it says where it resumes from, and that it waits for room)
                    self._set(job.id, JobStatus(JobState.QUEUED, "WaitingForCapacity", wait), expect={JobState.QUEUED})
                return  # FIFO: nothing overtakes the head of the queue
            self._launch(job, resolved)
            return  # one admission per tick (see above)

    def _preempt_for(self, head: JobRecord, plan: Plan, topo: ClusterTopology) -> str:
        """Suspend running jobs of lower priority if that makes room for ``head`` (each writes a checkpoint and
        goes back to the queue, to resume from it); what the head's waiting message adds."""
        running = [Running(job_id=j.id, priority=j.priority, seq=j.seq, plan=j.resolved.plan,
                           nodes=tuple(p["node_id"] for p in j.placement or ()),
                           suspendable=_suspendable(j), suspending=j.suspend_requested)
                   for j in self.store.list_jobs(states=ACTIVE, limit=10_000) if j.resolved is not None]
        chosen = victims(plan, head.priority, running, topo)
        if chosen is None:
            return ""
        for v in chosen:
            try:
                job = self.store.set_status(v.job_id, JobStatus(JobState.RUNNING, "Preempting",
                                            f"suspending for job {head.id} (priority {head.priority}): its workers "
                                            "write a checkpoint at their next step boundary and stop; it resumes "
                                            "from it when capacity returns"),
                                            expect={JobState.RUNNING}, unless_cancel_requested=True,
                                            suspend_requested=True)
            except InvalidTransition as e:
                log.info("job %s not suspended: %s", v.job_id, e)
                continue
            self.store.add_event(job.id, JobEvent(
                kind=EventKind.PREEMPTED, payload=Preempted(by_job=head.id, by_priority=head.priority),
                message=f"preempted by job {head.id} (priority {head.priority} > {job.priority}): checkpointing and "
                        "stopping at the next step boundary"))
            self.launcher.suspend(job.id)
        names = ", ".join(j.job_id for j in [*[r for r in running if r.suspending], *chosen])
        return f"; suspending lower-priority job(s) {names} to make room"

    def _resolved(self, job: JobRecord, topo: ClusterTopology) -> ResolvedJob | None:
        """The plan and config the job was given at submit. A job stored by an older service, which kept neither,
        is resolved now, once, and stored so; ``None`` if that fails (the job is then failed or left queued with
        the reason)."""
        if job.resolved is not None:
            return job.resolved
        try:
            resolved = self.resolve(job.request, job.id, topo)
        except InvalidJob as e:
            self._set(job.id, JobStatus(JobState.FAILED, "InvalidConfig", str(e)), expect={JobState.QUEUED})
            return None
        except Exception as e:  # noqa: BLE001 - the cluster cannot hold it now: say so, and try again next tick
            self._set(job.id, JobStatus(JobState.QUEUED, "Unschedulable",
                                        f"{e} (the job stays queued until the cluster can hold it; jobs "
                                        "behind it that fit are admitted meanwhile)"), expect={JobState.QUEUED})
            return None
        self.store.update_fields(job.id, resolved=resolved, plan=resolved.plan.to_dict())
        return resolved

    def _launch(self, job: JobRecord, resolved: ResolvedJob) -> None:
        plan, config = resolved.plan, resolved.config
        where = ", ".join(f"{plan.workers_in(dc)} in {dc}" for dc in plan.datacenters)
        try:
            # Compare-and-set: a cancel that landed since the queue was read wins, and nothing is launched.
            self.store.set_status(job.id, JobStatus(JobState.PLACING, "Placing", f"starting {plan.num_workers} workers ({where})"),
                                  expect={JobState.QUEUED})
        except InvalidTransition as e:
            log.info("job %s not launched: %s", job.id, e)
            return
        try:
            runner = self.launcher.launch(job.id, config, plan, min_workers=job.request.topology.min_workers)
        except Exception as e:  # noqa: BLE001 - report any launch failure on the job
            if self._stop.is_set():
                # The service stops (its Ray connection and store go): not the job's failure. It stays placing;
                # the next service finds its runner by name and starts it, or fails it if there is none.
                log.warning("job %s: launch interrupted by the service stopping (%s); left placing", job.id, e)
                return
            self._check_lease()  # another service follows the job now: it decides about its runner
            # The runner may exist (e.g. it was created but did not start in time): kill it, so nothing of
            # a job marked failed keeps running.
            try:
                self.launcher.release(job.id)
            except Exception:  # noqa: BLE001 - the failure below is what the user needs to see
                log.exception("killing the runner of job %s after its failed launch failed", job.id)
            self._set(job.id, JobStatus(JobState.FAILED, "LaunchFailed", f"could not start the job on Ray: {e}"))
            return
        if self._stop.is_set():
            return  # the next service reattaches to the runner by its name
        self._check_lease()
        self.store.update_fields(job.id, runner=runner)
        self._followed.add(job.id)

    def _follow(self, job: JobRecord) -> None:
        cursor = int((job.progress or {}).get("cursor", 0))
        try:
            poll: RunnerPoll | RunnerLost = self.launcher.poll(job.id, cursor)
        except RunnerLost as lost:
            poll = lost
        except Exception as e:  # a slow or unreachable runner: its deadlines still hold, else retried next tick
            self._check_lease()
            decision = unanswered(job, now=time.time(), deadlines=self.deadlines)
            if decision is None:
                raise  # recorded on the job and in /healthz by the tick (once per distinct error)
            log.warning("polling job %s failed (%s) past its deadline: ending it", job.id, e)
            self._carry_out(job, decision)
            return
        self._check_lease()  # the poll took a while: is this service still the one that stores it?
        decision = reconcile(
            job, poll, now=time.time(), first_sight=job.id not in self._followed,
            progress_due=time.monotonic() - self._last_progress_event.get(job.id, -1e9) >= PROGRESS_EVENT_EVERY_S,
            deadlines=self.deadlines, max_relaunches=self.max_relaunches,
        )
        self._carry_out(job, decision)

    def _carry_out(self, job: JobRecord, d: Decision) -> None:
        """Do what :func:`reconcile` decided, in its order (see :class:`Decision`)."""
        job_id = job.id
        if d.resume:
            try:
                self.launcher.resume(job_id)
            except Exception as e:  # noqa: BLE001 - retried next tick, like a slow poll
                log.warning("resuming the runner of job %s failed: %s", job_id, e)
                return
        if d.cancel:
            self.launcher.cancel(job_id)  # idempotent: repeated each tick until the runner stops
        if d.suspend:
            self.launcher.suspend(job_id)  # idempotent: repeated each tick until the checkpoint is written
        if d.store:
            self._followed.add(job_id)
        if d.emits_progress:
            self._last_progress_event[job_id] = time.monotonic()
        if d.status is not None:
            # Decided from the job as read: only if it is still so (a cancel meanwhile keeps its "Cancelling").
            self._set(job_id, d.status, expect={job.status.state}, unless_cancel_requested=True)
        if d.store:
            # The store and the API speak JSON: records become dicts here and nowhere earlier.
            self.store.record_poll(job_id, records=[r.to_dict() for r in d.records], events=list(d.events), **d.fields)
        if d.outcome is not None:
            # A preempted job goes back to the queue: its suspension is over.
            self._set(job_id, d.outcome, suspend_requested=False if d.outcome.state is JobState.QUEUED else None)
        if d.release:
            self.launcher.release(job_id)
        if d.forget:
            self._forget(job_id)
        if d.sweep_snapshots:
            # After a kill, once the workers it owned have gone too: a worker still writing would leave a folder.
            self.launcher.sweep_snapshots(job_id, after_s=RELEASED_WORKERS_GONE_S if d.release else 0.0)

    def _forget(self, job_id: str) -> None:
        self._followed.discard(job_id)
        self._last_progress_event.pop(job_id, None)

    def _set(self, job_id: str, status: JobStatus, *, expect: set[JobState] | None = None,
             unless_cancel_requested: bool = False, suspend_requested: bool | None = None) -> None:
        try:
            self.store.set_status(job_id, status, expect=expect, unless_cancel_requested=unless_cancel_requested,
                                  suspend_requested=suspend_requested)
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
                self.last_tick_at = time.monotonic()
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

    def health(self) -> dict[str, Any]:
        """For ``/healthz``: ``ok``; ``degraded`` (some jobs could not be followed on the last tick); or
        ``failing`` (ticks fail, or the loop has not completed one for a long time). Exception types and
        counts only: the messages may name other owners' jobs and data, and are in the log and job events."""
        status, problems = "ok", []
        if self.job_errors:
            status = "degraded"
            problems.append(f"{len(self.job_errors)} job(s) could not be followed on the last tick; their "
                            "events say why")
        if self.last_tick_error:
            status = "failing"
            problems.append(f"the supervisor's ticks fail ({self.last_tick_error.split(':', 1)[0]}); "
                            "the service log has the details")
        stale_after = max(30.0, 20 * self.poll_interval_s)
        if self._thread is not None and self.last_tick_at is not None and time.monotonic() - self.last_tick_at > stale_after:
            status = "failing"
            problems.append(f"no supervisor tick completed in the last {stale_after:.0f} s")
        return {"status": status, "problems": problems, "jobs_failing": len(self.job_errors)}
