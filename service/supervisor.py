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

from meridian.service.errors import InvalidTransition
from meridian.service.figures import figures_for
from meridian.service.jobs import JobRequest, JobState, JobStatus
from meridian.service.launcher import Launcher, RunnerLost, build_train_config
from meridian.service.planner import Plan, admission, plan_job
from meridian.service.store import JobRecord, JobStore
from meridian.service.topology import ClusterTopology

log = logging.getLogger(__name__)

ACTIVE = {JobState.PLACING, JobState.RUNNING}
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
                 lr=r["lr"], inter_dc_bytes=r.get("inter_dc_bytes", 0), updated_at=r["time"])
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
            runner = self.launcher.launch(job.id, config, plan)
        except Exception as e:  # noqa: BLE001 - report any launch failure on the job
            self._set(job.id, JobStatus(JobState.FAILED, "LaunchFailed", f"could not start the job on Ray: {e}"))
            return
        self.store.update_fields(job.id, runner=runner)

    def _follow(self, job: JobRecord) -> None:
        cursor = int((job.progress or {}).get("cursor", 0))
        try:
            poll = self.launcher.poll(job.id, cursor)
        except RunnerLost:
            if job.status.reason == "Cancelling":
                self._set(job.id, RUNNER_TERMINAL["cancelled"])
            else:
                self._set(job.id, JobStatus(JobState.FAILED, "RunnerLost",
                                            "the job's runner actor is gone (its node died or the Ray cluster "
                                            "restarted); resubmit the job"))
            return
        except Exception as e:  # noqa: BLE001 - a slow poll is retried next tick
            log.warning("polling job %s failed: %s", job.id, e)
            return
        records = [r for _, r in poll["records"]]
        self.store.add_metrics(job.id, records)
        placement = list(job.placement or [])
        for _, ev in poll["events"]:
            self.store.add_event(job.id, ev["kind"], ev["message"], ev["data"], at=ev["time"])
            if ev["kind"] == "worker_started":
                placement = [p for p in placement if p["rank"] != ev["data"]["rank"]] + [ev["data"]]
        fields: dict[str, Any] = {"progress": _progress(job.progress, records, poll["cursor"])}
        if placement != (job.placement or []):
            fields["placement"] = sorted(placement, key=lambda p: p["rank"])
        if poll["result"] is not None:
            fields["result"] = poll["result"]
        self.store.update_fields(job.id, **fields)

        state = poll["state"]
        if state == "running" and job.status.state is JobState.PLACING:
            self._set(job.id, JobStatus(JobState.RUNNING, "Training", "training steps are running"))
        elif state in RUNNER_TERMINAL:
            self._set(job.id, RUNNER_TERMINAL[state])
            self.launcher.release(job.id)
        elif state == "failed":
            self._set(job.id, JobStatus(JobState.FAILED, "TrainingError", poll["error"] or "training failed"))
            self.launcher.release(job.id)

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
