"""A job's events, typed: :class:`EventKind` names every kind, each with its payload dataclass, and
:class:`JobEvent` is one event. The one registry that the runner, the store, the event stream, the web page
(through ``GET /v1/event-kinds``) and the CLI share; strings and dicts appear only on the wire and in the store.

Workers report events as ``(kind, message, data)`` (:meth:`JobEvent.of` reads them); the control plane builds
them typed. A kind or field that is not declared here is refused, so what code branches on cannot drift from
what is sent. Torch-free and Ray-free: every side imports it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from meridian.workers.contracts.fields import from_plain, to_plain


@dataclass(frozen=True, kw_only=True)
class NoDetails:
    """The message says it all."""


@dataclass(frozen=True, kw_only=True)
class StateChanged:
    state: str
    """The job's state after the change (a ``JobState`` value)."""
    reason: str = ""
    message: str = ""
    previous: str | None = None
    """The state before (``None``: the job was just submitted)."""


@dataclass(frozen=True, kw_only=True)
class ProgressReport:
    step: int
    total_steps: int
    loss: float | None = None
    tokens_per_s: float | None = None
    lr: float | None = None
    inter_dc_bytes: float | None = None
    eta_s: float | None = None
    step_s: float | None = None
    data_s: float | None = None
    compute_s: float | None = None
    mfu: float | None = None


@dataclass(frozen=True, kw_only=True)
class WorkerStarted:
    node_id: str
    datacenter: str
    hostname: str = ""
    pid: int = 0
    ray_worker_id: str = ""
    device: str = ""
    time: float = 0.0
    worker_id: str = ""
    """The worker's id in the rendezvous (empty from a runner that ranks workers itself)."""
    rank: int | None = None
    """Set only by a runner that ranks workers itself; an elastic job's ranks come with ``epoch_formed``."""


@dataclass(frozen=True, kw_only=True)
class RankSlot:
    """Where one rank of an epoch runs."""

    rank: int
    worker_id: str
    node_id: str
    datacenter: str


@dataclass(frozen=True, kw_only=True)
class EpochFormed:
    epoch: int
    datacenters: tuple[str, ...]
    resume_step: int
    placement: tuple[RankSlot, ...]
    lost: tuple[str, ...] = ()
    newcomers: tuple[str, ...] = ()
    from_checkpoint: bool = False
    snapshot_every: int = 1
    time: float = 0.0


@dataclass(frozen=True, kw_only=True)
class WorkerLost:
    worker_id: str
    datacenter: str
    node_id: str


@dataclass(frozen=True, kw_only=True)
class WorkerRef:
    worker_id: str
    cause: str = ""
    """Why it was judged gone (:class:`~meridian.service.runner.liveness.judge.Cause`: ``node_dead``,
    ``process_gone``, ``host_unreachable``)."""


@dataclass(frozen=True, kw_only=True)
class WorkerStopped:
    """A member's training process of ``epoch`` was told to stop (it was stuck, or stranded with a dead peer)."""

    worker_id: str
    epoch: int


@dataclass(frozen=True, kw_only=True)
class NodeChanged:
    node_id: str
    datacenter: str


@dataclass(frozen=True, kw_only=True)
class DatacenterRef:
    datacenter: str


@dataclass(frozen=True, kw_only=True)
class ControllerKilled:
    waited_s: float
    placement_groups_removed: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class TrainRunRestarted:
    attempt: int
    gone: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class SyncDecided:
    """What an armed look-ahead decided, on the figures it measured (the slowest rank's medians)."""

    epoch: int
    lookahead: bool
    at_step: int
    exposed_s: float
    compute_s: float
    exact_step_s: float
    lookahead_step_s: float | None
    threshold: float
    steps_measured: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class StepsUnrecorded:
    from_step: int
    to_step: int
    epoch: int = 0
    """The epoch that formed after the break; 0 where the break was the loss of the job's runner (the steps are
    in the durable checkpoint the relaunched job loaded, their records were lost with the runner)."""


@dataclass(frozen=True, kw_only=True)
class StallSeen:
    """A rank stopped finishing steps (see :mod:`meridian.service.runner.liveness.judge`)."""

    rank: int
    step: int
    """Steps this rank had finished when it went quiet."""
    silent_s: float
    threshold_s: float
    median_step_s: float
    node_id: str
    datacenter: str


@dataclass(frozen=True, kw_only=True)
class RankSlow:
    """A rank computes its steps much slower than the others, who wait for it in every sync (see
    :mod:`meridian.service.runner.liveness.judge`)."""

    rank: int
    worker_id: str
    epoch: int
    step: int
    """Steps it had finished when judged slow."""
    node_id: str
    datacenter: str
    compute_s: float
    """Its median compute time per step over its recent steps."""
    peers_compute_s: float
    """The median of the other ranks' medians."""


@dataclass(frozen=True, kw_only=True)
class Reattached:
    cursor: int
    runner_state: str


@dataclass(frozen=True, kw_only=True)
class Gap:
    after: int
    through: int
    lost: int


@dataclass(frozen=True, kw_only=True)
class ErrorText:
    error: str


@dataclass(frozen=True, kw_only=True)
class EpochRestored:
    epoch: int
    setup_s: float
    restore_s: float
    state_bytes_sent: int | None = None
    state_bytes_cross_dc: int | None = None


@dataclass(frozen=True, kw_only=True)
class SnapshotCadence:
    snapshot_every: int
    loop_s: float
    write_s: float
    step_s: float


@dataclass(frozen=True, kw_only=True)
class CheckpointLoaded:
    step: int
    bytes_read: int = 0
    bytes_stored: int = 0


@dataclass(frozen=True, kw_only=True)
class ResumedFrom:
    """A new job started from another job's checkpoint (``resume_from``)."""

    source: str
    """What the job named: ``job <id>`` or the checkpoint's location."""
    checkpoint: str
    """The step folder read."""
    step: int
    """The steps that checkpoint holds."""
    start_step: int
    """The steps this job counts as done: the checkpoint's, or 0 with the schedule reset."""
    reset: tuple[str, ...] = ()
    bytes_read: int = 0


@dataclass(frozen=True, kw_only=True)
class RunnerRelaunched:
    """The job's runner actor was lost and the job went back to the queue to run again from its checkpoint."""

    attempt: int
    """This relaunch's number (1 for the first)."""
    max_relaunches: int
    """How many the service allows a job (``meridian serve --max-relaunches``)."""
    reason: str
    """What Ray said about the lost runner."""


@dataclass(frozen=True, kw_only=True)
class SnapshotsAdopted:
    folder: str


@dataclass(frozen=True, kw_only=True)
class ProcessKilled:
    worker_id: str
    signal: str
    pid: int
    killed_before_training: int = 0


@dataclass(frozen=True, kw_only=True)
class Preempted:
    """The job is being suspended for a job of higher priority, which it makes room for."""

    by_job: str
    by_priority: int


@dataclass(frozen=True, kw_only=True)
class DatasetCached:
    url: str
    worker_id: str
    node_id: str = ""
    datacenter: str = ""
    directory: str = ""
    """The node's cache of the dataset."""
    fetched: tuple[str, ...] = ()
    """Files copied because the cache lacked them."""
    refetched: tuple[str, ...] = ()
    """Files copied again because the cached copy did not match the manifest's hash."""


@dataclass(frozen=True, kw_only=True)
class TrackingFailed:
    tracker: str = ""
    """The tracker that failed (``tensorboard``, ``mlflow``, ``wandb``); empty: all of them, at the job's end."""
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class ProfileRequested:
    id: str
    """The profile request's id."""
    steps: int
    told: list[int] = field(default_factory=list)
    """The ranks the request reached."""
    unreachable: list[int] = field(default_factory=list)
    """The ranks that did not answer it."""


@dataclass(frozen=True, kw_only=True)
class ProfileRef:
    id: str
    """The profile request's id."""
    rank: int
    from_step: int = 0
    steps: int = 0
    to_step: int = 0
    path: str = ""
    """Where the trace was written (a captured profile)."""
    bytes: int = 0


class EventKind(str, enum.Enum):
    """Every kind of job event, with its payload type and what it means."""

    STATE = "state", StateChanged, "the job's state changed"
    PROGRESS = "progress", ProgressReport, "training progress (at most one a second)"
    WORKER_STARTED = "worker_started", WorkerStarted, "a worker process started on a node"
    EPOCH_FORMED = "epoch_formed", EpochFormed, "a membership (epoch) formed: its ranks and where it resumes"
    WORKER_LOST = "worker_lost", WorkerLost, "a member did not come back: the epoch re-formed without it"
    WORKER_GONE = "worker_gone", WorkerRef, "a worker's process no longer answers: it is not waited for"
    WORKER_STUCK = "worker_stuck", WorkerStopped, "a member that answers but did not rejoin was told to stop"
    WORKER_STRANDED = "worker_stranded", WorkerStopped, "members waiting on a dead node were told to stop"
    WAITING = "waiting", NoDetails, "the membership waits (for workers, a re-formation or capacity)"
    NODE_LOST = "node_lost", NodeChanged, "a node of the cluster died"
    NODE_JOINED = "node_joined", NodeChanged, "a node joined the cluster"
    WORKER_REPLACING = "worker_replacing", DatacenterRef, "capacity returned: a replacement worker starts"
    SNAPSHOTS_NOT_SWEPT = "snapshots_not_swept", NoDetails, "the job's in-memory snapshots could not be removed"
    TRAIN_CONTROLLER_KILLED = "train_controller_killed", ControllerKilled, "Ray Train's controller was killed"
    TRAIN_RUN_RESTARTED = "train_run_restarted", TrainRunRestarted, "a new Ray Train run replaced a failed one"
    SYNC_DECIDED = "sync_decided", SyncDecided, "an armed look-ahead decided exact or look-ahead sync"
    STEPS_UNRECORDED = "steps_unrecorded", StepsUnrecorded, "steps trained before a re-formation or a lost runner have no record"
    WATCH_ERROR = "watch_error", NoDetails, "the runner's watch of the cluster failed (it retries)"
    STALL = "stall", StallSeen, "a rank stopped finishing steps"
    RANK_SLOW = "rank_slow", RankSlow, "a rank computes its steps much slower than the others"
    REATTACHED = "reattached", Reattached, "a restarted service found the job's runner again"
    GAP = "gap", Gap, "records or events were dropped before the service collected them"
    SUPERVISOR_ERROR = "supervisor_error", ErrorText, "the service could not follow the job on a tick"
    FINAL_EVAL_SKIPPED = "final_eval_skipped", NoDetails, "the final evaluation was skipped"
    EPOCH_RESTORED = "epoch_restored", EpochRestored, "an epoch's process group, model and state are ready"
    SNAPSHOT_CADENCE = "snapshot_cadence", SnapshotCadence, "state snapshots are taken every k steps from now"
    STATE_INCOMPLETE = "state_incomplete", NoDetails, "no full copy of the state in memory: from the checkpoint"
    RESTARTED = "restarted", NoDetails, "no state survived and no checkpoint exists: training restarts at step 0"
    CHECKPOINT_LOADED = "checkpoint_loaded", CheckpointLoaded, "the job resumed from its durable checkpoint"
    RESUMED_FROM = "resumed_from", ResumedFrom, "a new job started from another job's checkpoint (resume_from)"
    RUNNER_RELAUNCHED = "runner_relaunched", RunnerRelaunched, "the runner was lost: the job runs again from its checkpoint"
    SNAPSHOTS_ADOPTED = "snapshots_adopted", SnapshotsAdopted, "a worker took over a gone worker's snapshots"
    TRAINING_PROCESS_KILLED = "training_process_killed", ProcessKilled, "a training process was killed; restarting"
    PREEMPTED = "preempted", Preempted, "being suspended for a job of higher priority (it checkpoints and requeues)"
    DATASET_CACHED = "dataset_cached", DatasetCached, "a worker copied a dataset given by URL into its node's cache"
    TRACKING_FAILED = "tracking_failed", TrackingFailed, "an experiment tracker failed; the job trains on without it"
    PROFILE_REQUESTED = "profile_requested", ProfileRequested, "a person asked ranks for a profiler trace"
    PROFILE_STARTED = "profile_started", ProfileRef, "a rank started recording a profiler trace"
    PROFILE_CAPTURED = "profile_captured", ProfileRef, "a rank wrote a profiler trace"
    PROFILE_FAILED = "profile_failed", ProfileRef, "a rank could not record or keep a profiler trace"
    MALFORMED = "malformed_event", ErrorText, "an event that does not match this registry (a bug to report)"

    payload: type
    description: str

    def __new__(cls, value: str, payload: type, description: str) -> EventKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.payload = payload
        member.description = description
        return member

    @classmethod
    def known(cls, value: str) -> EventKind | None:
        """The kind named ``value``, or ``None`` for one not in this registry (stored by an older version)."""
        try:
            return cls(value)
        except ValueError:
            return None


def registry() -> list[dict[str, Any]]:
    """Every kind with its description and payload fields, for clients (``GET /v1/event-kinds``)."""
    return [{"kind": k.value, "description": k.description, "fields": [f.name for f in fields(k.payload)]}
            for k in EventKind]


@dataclass(frozen=True, kw_only=True)
class JobEvent:
    """One event of a job: its kind, a sentence for people, the typed payload, and when (wall clock)."""

    kind: EventKind
    message: str
    payload: Any = field(default_factory=NoDetails)
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, EventKind):
            raise TypeError(f"kind must be an EventKind, got {self.kind!r}")
        if not isinstance(self.payload, self.kind.payload):
            raise TypeError(f"a {self.kind.value} event carries a {self.kind.payload.__name__}, "
                            f"got {type(self.payload).__name__}")

    @classmethod
    def of(cls, kind: str | EventKind, message: str, data: Mapping[str, Any] | None = None, *,
           at: float | None = None) -> JobEvent:
        """An event from its wire form; ``ValueError`` naming the kind or field that is not in the registry."""
        k = EventKind.known(kind) if isinstance(kind, str) else kind
        if k is None:
            raise ValueError(f"event kind {kind!r} is not in meridian.workers.contracts.events.EventKind")
        data = dict(data or {})
        extra = set(data) - {f.name for f in fields(k.payload)}
        if extra:
            raise ValueError(f"a {k.value} event has no field(s) {sorted(extra)} ({k.payload.__name__})")
        try:
            payload = from_plain(k.payload, data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"a {k.value} event's data does not match {k.payload.__name__}: {e}") from None
        return cls(kind=k, message=message, payload=payload, time=time.time() if at is None else at)

    @classmethod
    def parsed_or_malformed(cls, kind: str, message: str, data: Mapping[str, Any] | None = None,
                            *, at: float | None = None) -> JobEvent:
        """:meth:`of`, or a :attr:`EventKind.MALFORMED` event saying what did not match (nothing is dropped)."""
        try:
            return cls.of(kind, message, data, at=at)
        except ValueError as e:
            return cls(kind=EventKind.MALFORMED, message=f"{kind}: {message}", payload=ErrorText(error=str(e)),
                       time=time.time() if at is None else at)

    @property
    def data(self) -> dict[str, Any]:
        """The payload's wire form (what the store keeps and the API serves)."""
        return to_plain(self.payload)
