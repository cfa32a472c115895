"""What one poll of a job's runner means for the job, decided apart from doing it.

:func:`reconcile` takes the job as stored and what its runner answered (a
:class:`~meridian.service.runner.poll.RunnerPoll`, or :class:`~meridian.service.runner.poll.RunnerLost`) and
returns a :class:`Decision`: the status to set before and after storing the poll, the records, events and
job fields to store, and whether to resume, release or forget the runner. The supervisor
(:mod:`meridian.service.supervision.supervisor`) carries a decision out. Everything it needs is in the job and
the poll (typed events, the ranks' placement, stalls already named by the runner): it never reads the job's
stored events back.

Pure: no store, no Ray, no clock (the caller passes ``now``), so every rule is tested by asserting on the
decision (tests/test_reconcile.py). Must never write anything or call the launcher.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meridian.service.jobs import JobState, JobStatus
from meridian.service.runner.poll import RunnerLost, RunnerPoll, RunnerState
from meridian.service.store import JobRecord
from meridian.workers.contracts.events import (
    EventKind,
    JobEvent,
    ProgressReport,
    Reattached,
    RunnerRelaunched,
    StepsUnrecorded,
)
from meridian.workers.contracts.fields import to_plain
from meridian.workers.contracts.records import StepRecord

PROGRESS_FIELDS = ("step", "total_steps", "loss", "tokens_per_s", "lr", "inter_dc_bytes", "eta_s", "step_s", "data_s",
                   "compute_s", "mfu")
RUNNER_OUTCOME = {
    RunnerState.SUCCEEDED: JobStatus(JobState.SUCCEEDED, "Completed", "training finished"),
    RunnerState.CANCELLED: JobStatus(JobState.CANCELLED, "Cancelled",
                                     "cancelled by request; workers stopped and placement freed"),
}
TRAINING = JobStatus(JobState.RUNNING, "Training", "training steps are running")
WAITING_FOR_WORKERS = "WaitingForWorkers"
RELAUNCHING = "Relaunching"
DEFAULT_MAX_RELAUNCHES = 3
"""How many times a job whose runner actor was lost goes back to the queue, to run again from its newest
checkpoint, before it fails (``meridian serve --max-relaunches``)."""


@dataclass(frozen=True)
class Deadlines:
    """How long a job may wait on its runner before the service gives up on it (every wait has one)."""

    placing_s: float = 900.0
    """From entering ``placing`` to the first training step (workers scheduled, started and joined)."""
    cancel_s: float = 120.0
    """From a cancel request to the runner saying it stopped; then the runner is killed."""
    suspend_s: float = 300.0
    """From a preemption to the runner saying its checkpoint is written; then it is killed, and the job is queued
    to resume from its newest durable checkpoint."""


DEFAULT_DEADLINES = Deadlines()


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do about one poll, in the order the supervisor does it."""

    cancel: bool = False
    """Tell the runner to stop (again): the job has a cancel request and its runner still runs."""
    suspend: bool = False
    """Tell the runner to checkpoint and stop (again): the job is being preempted."""
    resume: bool = False
    """Start a found runner that never started (a service killed between creating and starting it); if
    that fails, nothing else of this decision is done and the next tick decides again."""
    status: JobStatus | None = None
    """Set before the poll is stored, so the event log reads "running" before the first progress."""
    store: bool = True
    """Store the poll (``records``, ``events``, ``fields``) in one transaction; ``False``: nothing to store."""
    records: tuple[StepRecord, ...] = ()
    events: tuple[JobEvent, ...] = ()
    fields: Mapping[str, Any] = field(default_factory=dict)
    """Job fields to store with the poll: ``progress`` (with the cursor), ``placement``, ``result``."""
    outcome: JobStatus | None = None
    """The job's final status, set after the poll is stored."""
    release: bool = False
    """Kill the runner: its job is over."""
    forget: bool = False
    """Drop what the supervisor remembers about the job (it is no longer followed)."""
    sweep_snapshots: bool = False
    """Remove the job's in-memory snapshot folders on every node: its runner, which does that at the job's end, is
    gone or is being killed (a missed deadline), and the workers it owned go with it (their folders, weights and
    AdamW state in RAM, stay otherwise)."""

    @property
    def emits_progress(self) -> bool:
        return any(ev.kind is EventKind.PROGRESS for ev in self.events)


def reconcile(
    job: JobRecord, poll: RunnerPoll | RunnerLost, *, now: float = 0.0, first_sight: bool = False,
    progress_due: bool = True, deadlines: Deadlines = DEFAULT_DEADLINES, max_relaunches: int = DEFAULT_MAX_RELAUNCHES,
) -> Decision:
    """The decision for ``job`` after its runner answered ``poll``.

    ``first_sight``: this supervisor has not followed the job before (the service restarted while it was
    active). ``progress_due``: a ``progress`` event may be added (they are rate-limited by the caller).
    ``now``: wall-clock time, for the events this decision adds and the ``deadlines``. ``max_relaunches``: how
    many times a job whose runner is lost is queued again before it fails.
    """
    if isinstance(poll, RunnerLost):
        return _lost(job, poll, now=now, max_relaunches=max_relaunches)
    overdue = _overdue(job, poll.state, now, deadlines)
    if overdue is not None:
        return _ended_overdue(job, overdue)
    events: list[JobEvent] = list(poll.events)
    cursor = int((job.progress or {}).get("cursor", 0))
    resume = False
    if first_sight:
        resume = poll.state is RunnerState.STARTING and not job.cancel_requested
        events.insert(0, JobEvent(kind=EventKind.REATTACHED, time=now,
                                  payload=Reattached(cursor=cursor, runner_state=poll.state.value),
                                  message=f"service restarted; reattached to {job.runner or 'the runner'} "
                                          f"({poll.state.value}), resuming after record {cursor}"))
    events += _unrecorded_before_checkpoint(job, poll.events, now)
    progress = fold_progress(job.progress, poll.records, poll.cursor)
    if poll.records and progress_due:
        # Live progress for event streams (rate-limited by the caller so a long job does not fill the event table).
        loss = progress.get("loss")
        loss_text = f"{loss:.4f}" if isinstance(loss, (int, float)) else "-"
        events.append(JobEvent(
            kind=EventKind.PROGRESS, time=progress.get("updated_at") or now,
            message=f"step {progress['step']}/{progress['total_steps']} loss {loss_text}",
            payload=ProgressReport(**{k: progress[k] for k in PROGRESS_FIELDS if k in progress})))
    fields: dict[str, Any] = {"progress": progress}
    placement = [to_plain(p) for p in poll.placement] if poll.placement is not None else []
    if placement and placement != (job.placement or []):
        fields["placement"] = placement
    if poll.result is not None:
        fields["result"] = job_losses(dict(poll.result), progress)
    outcome = None
    if poll.state is RunnerState.SUSPENDED:
        outcome = preempted(f"its workers wrote a checkpoint of step {poll.suspended_step} and stopped")
        # The next runner numbers what it reports from 0, and places its ranks anew.
        fields["progress"] = {**progress, "cursor": 0}
        fields["placement"] = []
    elif poll.state.is_terminal:
        outcome = RUNNER_OUTCOME.get(poll.state) or JobStatus(
            JobState.FAILED, "TrainingError", poll.error or "training failed")
    return Decision(
        cancel=job.cancel_requested and outcome is None, resume=resume,
        suspend=job.suspend_requested and not job.cancel_requested and outcome is None,
        status=_running_status(job, poll), records=poll.records, events=tuple(events), fields=fields,
        outcome=outcome, release=outcome is not None, forget=outcome is not None,
    )


def _unrecorded_before_checkpoint(job: JobRecord, events: Sequence[JobEvent], now: float) -> list[JobEvent]:
    """A ``steps_unrecorded`` event for the steps the checkpoint a job's new runner loaded holds beyond the job's
    last stored record. A runner keeps the newest records until the service's next poll (and rank 0 sends a step's
    record a few steps late, once its loss is summed over the ranks): a runner that is lost, or whose workers stop
    for a preemption, takes those with it. The steps were trained and kept, but their records will never come."""
    stored = int((job.progress or {}).get("step") or 0)
    loaded = [e.payload.step for e in events if e.kind is EventKind.CHECKPOINT_LOADED and hasattr(e.payload, "step")]
    if not loaded or max(loaded) <= stored:
        return []
    first, last = stored + 1, max(loaded)
    steps = f"step {first}" if first == last else f"steps {first}–{last}"
    return [JobEvent(kind=EventKind.STEPS_UNRECORDED, time=now, payload=StepsUnrecorded(from_step=first, to_step=last),
                     message=f"{steps} trained and kept in the checkpoint of step {last} "
                             f"{'has' if first == last else 'have'} no record: the job's previous runner ended "
                             "before the service had read it")]


def job_losses(result: dict[str, Any], progress: Mapping[str, Any]) -> dict[str, Any]:
    """``result`` with the job's first and last step losses from its step records (``progress``). The workers'
    result covers their last epoch only: after a re-formation its first loss was that epoch's first step's, and an
    epoch that resumed at the last step (a peer lost during the final checkpoint or evaluation) trained none, so
    both were NaN (``null`` in the API, and ``meridian run`` failed formatting it)."""
    if isinstance(progress.get("first_loss"), (int, float)):
        result["first_loss"] = progress["first_loss"]
    final = result.get("final_loss")
    missing = final is None or (isinstance(final, float) and math.isnan(final))
    at_end = progress.get("step") is not None and progress.get("step") == progress.get("total_steps")
    if missing and at_end and isinstance(progress.get("loss"), (int, float)):
        result["final_loss"] = progress["loss"]
    return result


def fold_progress(previous: Mapping[str, Any] | None, records: Sequence[StepRecord], cursor: int) -> dict[str, Any]:
    """Fold new per-step records into the job's progress summary (with a smoothed ETA)."""
    p = dict(previous or {})
    for r in records:
        ema = p.get("step_s_ema")
        p["step_s_ema"] = r.step_s if ema is None else 0.8 * ema + 0.2 * r.step_s
        p.update(step=r.step, total_steps=r.total_steps, loss=r.loss, tokens_per_s=r.tokens_per_s, lr=r.lr,
                 inter_dc_bytes=r.inter_dc_bytes, updated_at=r.time, step_s=r.step_s, data_s=r.data_s,
                 compute_s=r.compute_s, mfu=r.mfu)
        p.setdefault("first_loss", r.loss)
    if "step" in p:
        p["eta_s"] = max(0.0, (p["total_steps"] - p["step"]) * p["step_s_ema"])
    p["cursor"] = cursor
    return p


PREEMPTED = "Preempted"


def preempted(how: str) -> JobStatus:
    """The queued status of a job suspended for one of higher priority."""
    return JobStatus(JobState.QUEUED, PREEMPTED, f"suspended for a job of higher priority: {how}; it resumes from "
                     "its newest checkpoint when capacity returns")


def _lost(job: JobRecord, lost: RunnerLost, *, now: float, max_relaunches: int) -> Decision:
    if job.cancel_requested:  # the runner went away while stopping: that is the cancel done
        return Decision(store=False, outcome=RUNNER_OUTCOME[RunnerState.CANCELLED], forget=True, sweep_snapshots=True)
    said = str(lost)[:300]
    if job.relaunches < max_relaunches:
        # Back to the queue, as a preempted job goes: admission places it again when it fits, and its new runner's
        # workers restore the job's newest durable checkpoint (or its resume_from's, or step 0 if it has none).
        # Its snapshot folders are left to that runner (a sweep now could remove the new workers' folders), which
        # removes them at the job's end; its next runner numbers what it reports from 0 and places its ranks anew.
        # Released: the placement groups its Train controllers made would hold its CPUs (the launcher removes them).
        attempt = job.relaunches + 1
        event = JobEvent(kind=EventKind.RUNNER_RELAUNCHED, time=now,
                         payload=RunnerRelaunched(attempt=attempt, max_relaunches=max_relaunches, reason=said),
                         message=f"the job's runner actor is gone; relaunching the job from its newest checkpoint "
                                 f"(relaunch {attempt} of at most {max_relaunches}). Ray said: {said}")
        return Decision(events=(event,), forget=True, release=True,
                        fields={"progress": {**(job.progress or {}), "cursor": 0}, "placement": [],
                                "relaunches": attempt},
                        outcome=JobStatus(JobState.QUEUED, RELAUNCHING,
                                          f"its runner actor was lost (its node died or the Ray cluster restarted): "
                                          f"queued to run again from its newest checkpoint (relaunch {attempt} of "
                                          f"at most {max_relaunches})"))
    tried = (f" after {job.relaunches} relaunch(es), the most this service allows (meridian serve "
             "--max-relaunches)") if max_relaunches else ""
    return Decision(store=False, forget=True, sweep_snapshots=True, release=True, outcome=JobStatus(
        JobState.FAILED, "RunnerLost", f"the job's runner actor is gone (its node died or the Ray cluster "
        f"restarted){tried}; resubmit the job (with \"resume_from\": {{\"job\": \"{job.id}\"}} it starts from "
        f"its newest checkpoint). Ray said: {said}"))


def unanswered(job: JobRecord, *, now: float, deadlines: Deadlines = DEFAULT_DEADLINES) -> Decision | None:
    """The decision for ``job`` when its runner did not answer the poll (a timeout, an actor that cannot be
    reached) but is not known gone: a missed deadline ends the job as it would after an answer, and the runner
    is killed; else ``None`` (the next tick polls again). Without this a hung runner kept a placing job placing,
    and every job behind it queued, forever."""
    overdue = _overdue(job, None, now, deadlines)
    if overdue is None:
        return None
    return _ended_overdue(job, overdue)


def _ended_overdue(job: JobRecord, outcome: JobStatus) -> Decision:
    """A missed deadline: the runner is killed and the job ends with ``outcome`` (a preempted one goes back to the
    queue, its next runner reporting from cursor 0)."""
    if outcome.state is JobState.QUEUED:
        return Decision(outcome=outcome, release=True, forget=True, sweep_snapshots=True,
                        fields={"progress": {**(job.progress or {}), "cursor": 0}, "placement": []})
    return Decision(store=False, outcome=outcome, release=True, forget=True, sweep_snapshots=True)


def _overdue(job: JobRecord, state: RunnerState | None, now: float, deadlines: Deadlines) -> JobStatus | None:
    """The final status of a job whose runner missed a deadline (it is then killed), else ``None``; ``state``:
    what the runner answered, ``None`` when it did not answer."""
    if state is not None and state.is_terminal:
        return None
    if (job.suspend_requested and not job.cancel_requested
            and now - (job.suspend_requested_at or now) > deadlines.suspend_s):
        return preempted(f"its runner did not write the checkpoint within {deadlines.suspend_s:.0f} s and was "
                         "killed with its workers")
    if job.cancel_requested and now - (job.cancel_requested_at or now) > deadlines.cancel_s:
        return JobStatus(JobState.CANCELLED, "CancelTimedOut",
                         f"the runner did not stop within {deadlines.cancel_s:.0f} s of the cancel request; "
                         "it was killed with its workers")
    if (job.status.state is JobState.PLACING and state in (RunnerState.STARTING, None)
            and now - (job.state_since or now) > deadlines.placing_s):
        return JobStatus(JobState.FAILED, "PlacingTimedOut",
                         f"no training step within {deadlines.placing_s:.0f} s of placing the job (workers not "
                         "scheduled or not starting: check the cluster's free resources and the worker logs); "
                         "the runner was killed, resubmit the job")
    return None


def _running_status(job: JobRecord, poll: RunnerPoll) -> JobStatus | None:
    """Training, or waiting for workers, while the runner runs (``None``: the status stays as it is)."""
    if poll.state is not RunnerState.RUNNING or job.cancel_requested or job.suspend_requested:
        return None  # a job being cancelled or suspended keeps saying so until its runner stops
    if poll.wait_reason and job.status.state is JobState.RUNNING:
        # e.g. after losing nodes: below min_workers the job waits for capacity instead of failing
        if job.status.message != poll.wait_reason:
            return JobStatus(JobState.RUNNING, WAITING_FOR_WORKERS, poll.wait_reason)
        return None
    if job.status.state is JobState.PLACING or job.status.reason == WAITING_FOR_WORKERS:
        return TRAINING
    return None
