"""The control loop: admit queued jobs, follow running ones, record what happens.

One :meth:`Supervisor.tick` reads the cluster once, admits what fits (FIFO by priority, no overtaking),
then polls every active job's runner from the cursor stored with the job, so the store always holds every
record exactly once even across service restarts. Ray is reached only through the ``launcher`` and the
``read_topology`` callable, so the loop is tested one tick at a time against fakes.
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
from meridian.service.launcher import Launcher, RunnerLost, build_train_config
from meridian.service.planning.figures import figures_for
from meridian.service.planning.planner import Plan, admission, plan_job
from meridian.service.store import JobRecord, JobStore
from meridian.service.supervision.stall import StallPolicy, find_stalls

log = logging.getLogger(__name__)

ACTIVE = {JobState.PLACING, JobState.RUNNING}
PROGRESS_EVENT_EVERY_S = 1.0
PROGRESS_FIELDS = ("step", "total_steps", "loss", "tokens_per_s", "lr", "inter_dc_bytes", "eta_s")
RUNNER_TERMINAL = {
    "succeeded": JobStatus(JobState.SUCCEEDED, "Completed", "training finished"),
    "cancelled": JobStatus(JobState.CANCELLED, "Cancelled", "cancelled by request; workers stopped and placement freed"),
}


def _progress(previous: dict[str, Any] | None, records: list[dict[str, Any]], cursor: int) -> dict[str, Any]:
    """Fold new per-step records into the job's progress summary (with a smoothed ETA)."""
    p = dict(previous or {})
    for r in records:
        ema = p.get("step_s_ema")
        p["step_s_ema"] = r["step_s"] if ema is None else 0.8 * ema + 0.2 * r["step_s"]
        p.update(step=r["step"], total_steps=r["total_steps"], loss=r["loss"], tokens_per_s=r["tokens_per_s"],
                 lr=r["lr"], inter_dc_bytes=r.get("inter_dc_bytes", 0), updated_at=r["time"],
                 step_s=r["step_s"], data_s=r.get("data_s"), compute_s=r.get("compute_s"), mfu=r.get("mfu"))
        p.setdefault("first_loss", r["loss"])
    if "step" in p:
        p["eta_s"] = max(0.0, (p["total_steps"] - p["step"]) * p["step_s_ema"])
    p["cursor"] = cursor
    return p


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
        job = self.store.set_status(job_id, JobStatus(job.status.state, "Cancelling", "cancel requested; stopping the workers"))
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
        ckpt_dir = os.path.join(self.checkpoint_root, job.id) if job.request.checkpoint_every else ""
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
            poll = self.launcher.poll(job.id, cursor)
        except RunnerLost as lost:
            self._forget(job.id)
            if job.status.reason == "Cancelling":
                self._set(job.id, RUNNER_TERMINAL["cancelled"])
            else:
                self._set(job.id, JobStatus(JobState.FAILED, "RunnerLost",
                                            "the job's runner actor is gone (its node died or the Ray cluster "
                                            f"restarted); resubmit the job. Ray said: {str(lost)[:300]}"))
            return
        except Exception as e:  # noqa: BLE001 - a slow poll is retried next tick
            log.warning("polling job %s failed: %s", job.id, e)
            return
        records = [r for _, r in poll["records"]]
        events = [ev for _, ev in poll["events"]]
        if job.id not in self._followed:
            # A job this instance did not launch: the service restarted while it was active.
            if poll["state"] == "starting" and job.status.reason != "Cancelling":
                try:
                    self.launcher.resume(job.id)
                except Exception as e:  # noqa: BLE001 - retried next tick, like a slow poll
                    log.warning("resuming the runner of job %s failed: %s", job.id, e)
                    return
            self._followed.add(job.id)
            events.insert(0, {"kind": "reattached", "time": time.time(), "data": {"cursor": cursor, "runner_state": poll["state"]},
                              "message": f"service restarted; reattached to {job.runner or 'the runner'} "
                                         f"({poll['state']}), resuming after record {cursor}"})
        placement = list(job.placement or [])
        for ev in events:
            if ev["kind"] == "epoch_formed":  # the ranks of the current membership
                placement = self._placement(job.id, ev["data"]["placement"], events)
            elif ev["kind"] == "worker_started" and "rank" in ev["data"]:  # a runner that ranks workers itself
                placement = [p for p in placement if p["rank"] != ev["data"]["rank"]] + [ev["data"]]
        self._name_stalls(job.id, poll, placement)
        progress = _progress(job.progress, records, poll["cursor"])
        if records and time.monotonic() - self._last_progress_event.get(job.id, -1e9) >= PROGRESS_EVENT_EVERY_S:
            # Live progress for event streams, rate-limited so a long job does not fill the event table.
            self._last_progress_event[job.id] = time.monotonic()
            loss = progress.get("loss")
            loss_text = f"{loss:.4f}" if isinstance(loss, (int, float)) else "-"
            events.append({"kind": "progress", "time": progress.get("updated_at"),
                           "message": f"step {progress['step']}/{progress['total_steps']} loss {loss_text}",
                           "data": {k: progress[k] for k in PROGRESS_FIELDS if k in progress}})
        fields: dict[str, Any] = {"progress": progress}
        if placement != (job.placement or []):
            fields["placement"] = sorted(placement, key=lambda p: p["rank"])
        if poll["result"] is not None:
            fields["result"] = poll["result"]
        state = poll["state"]
        waiting = (poll.get("membership") or {}).get("wait_reason", "")
        if state == "running" and waiting and job.status.state is JobState.RUNNING:
            # e.g. after losing nodes: below min_workers the job waits for capacity instead of failing
            if job.status.message != waiting:
                self._set(job.id, JobStatus(JobState.RUNNING, "WaitingForWorkers", waiting))
        elif state == "running" and (job.status.state is JobState.PLACING or job.status.reason == "WaitingForWorkers"):
            # Before the poll's records, so the event log reads "running" and then the first progress.
            self._set(job.id, JobStatus(JobState.RUNNING, "Training", "training steps are running"))
        self.store.record_poll(job.id, records=records, events=events, **fields)

        if state in RUNNER_TERMINAL:
            self._set(job.id, RUNNER_TERMINAL[state])
            self.launcher.release(job.id)
            self._forget(job.id)
        elif state == "failed":
            self._set(job.id, JobStatus(JobState.FAILED, "TrainingError", poll["error"] or "training failed"))
            self.launcher.release(job.id)
            self._forget(job.id)

    def _forget(self, job_id: str) -> None:
        self._followed.discard(job_id)
        self._last_progress_event.pop(job_id, None)
        self._stalls_named.pop(job_id, None)

    def _name_stalls(self, job_id: str, poll: dict[str, Any], placement: list[dict[str, Any]]) -> None:
        """Record each rank that stopped finishing steps as a ``stall`` event, once per (rank, step).

        Not while the membership waits (for workers, or for a re-formation) or after the last step: ranks are
        idle then by design, and the events already say why."""
        membership = poll.get("membership") or {}
        if not poll.get("heartbeats") or membership.get("wait_reason") or membership.get("finished"):
            return
        where = {p["rank"]: p for p in placement}
        named = self._stalls_named.setdefault(job_id, set())
        for stall in find_stalls(poll["heartbeats"], poll["recent_step_s"], poll["now"], where, self.stall_policy):
            if (stall.rank, stall.step) not in named:
                named.add((stall.rank, stall.step))
                self.store.add_event(job_id, "stall", stall.message(), stall.to_dict(), at=poll["now"])

    def _placement(self, job_id: str, members: list[dict[str, Any]], batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each rank of an epoch with what its worker said when it started (host, pid, device)."""
        started = {e.data.get("worker_id"): e.data for e in self.store.list_events(job_id, limit=100_000)
                   if e.kind == "worker_started"}
        started.update({e["data"].get("worker_id"): e["data"] for e in batch if e["kind"] == "worker_started"})
        return [{**started.get(m["worker_id"], {}), **m} for m in members]

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

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is queued or active (used by tests and the demo). False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.store.list_jobs(states=ACTIVE | {JobState.QUEUED}, limit=1):
                return True
            time.sleep(0.2)
        return False
