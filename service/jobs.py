"""Jobs as the control plane sees them: what was asked (:class:`JobRequest`), where a job is in its life
(:class:`JobState`, :class:`JobStatus`), and the one function that moves it (:func:`transition`).

States know whether they are terminal and carry why they are where they are (``reason`` + ``message``,
as Kueue and Slurm do for pending jobs). Strings appear only in the store and on the wire.

A request reuses the frozen worker configs for what it shares with them (model, data, optimizer, sync,
WAN) and declares the training knobs it shares with :class:`TrainConfig` with ``like`` (the same default
and bounds); only what the planner decides (``None``: "auto") is request-only. The store keeps
:meth:`JobRequest.to_dict`; :meth:`JobRequest.from_dict` rebuilds it generically from the type hints.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from meridian.service.errors import InvalidTransition
from meridian.workers.contracts.config import (
    ActivationCheckpointing,
    DataConfig,
    OptimConfig,
    ParallelConfig,
    PipelineSchedule,
    Precision,
    ResetPart,
    SyncConfig,
    TrainConfig,
    ValidationConfig,
    WanConfig,
    check_batches,
    check_model_parallel_sync,
)
from meridian.workers.contracts.fields import (
    Bounds,
    bounds_of,
    check_bounds,
    from_plain,
    knob,
    like,
    to_plain,
)
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.contracts.tracking import TrackingConfig


class JobState(str, enum.Enum):
    QUEUED = "queued"  # accepted; waiting for capacity (reason says for what)
    PLACING = "placing"  # workers are being placed and started on Ray
    RUNNING = "running"  # training steps are running
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


_ALLOWED: dict[JobState, set[JobState]] = {
    JobState.QUEUED: {JobState.PLACING, JobState.FAILED, JobState.CANCELLED},
    # A placement that loses its capacity goes back to the queue; a running job whose groups are being
    # re-formed after a node loss goes back to placing.
    JobState.PLACING: {JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED, JobState.SUCCEEDED},
    # A running job preempted by one of higher priority goes back to the queue, from its checkpoint.
    JobState.RUNNING: {JobState.PLACING, JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED},
    JobState.SUCCEEDED: set(),
    JobState.FAILED: set(),
    JobState.CANCELLED: set(),
}


@dataclass(frozen=True)
class JobStatus:
    state: JobState
    reason: str = ""
    """A short CamelCase cause, e.g. ``WaitingForCapacity``, ``NodeLost``, ``TrainingError``."""
    message: str = ""
    """What happened and what to do about it, in plain words."""


def transition(current: JobStatus, new: JobStatus) -> JobStatus:
    """The only place job states change. Same-state updates (a new reason) are always allowed."""
    if new.state != current.state and new.state not in _ALLOWED[current.state]:
        raise InvalidTransition(f"a {current.state.value} job cannot become {new.state.value}")
    return new


WORKERS_PER_DC = Bounds(ge=1, le=4096)
"""Bounds of a per-datacenter worker count."""


@dataclass(frozen=True, kw_only=True)
class TopologyRequest:
    """Where the job should run. ``None`` fields mean "let the planner choose" (``auto``)."""

    datacenters: tuple[str, ...] | None = None
    """Datacenters to use, in order; ``None`` = every datacenter with capacity."""
    workers_per_datacenter: int | tuple[tuple[str, int], ...] | None = None
    """Workers in each datacenter (one number for all, or per name); ``None`` = as many as fit."""
    min_workers: int = knob(1, ge=1, le=65536)
    """Below this many live workers the job waits for capacity instead of training."""

    def __post_init__(self) -> None:
        check_bounds(self, "topology.")
        w = self.workers_per_datacenter
        for count in [w] if isinstance(w, int) else [n for _, n in w or ()]:
            WORKERS_PER_DC.check("topology.workers_per_datacenter", count)
        if isinstance(w, tuple) and self.datacenters is not None:
            extra = {dc for dc, _ in w} - set(self.datacenters)
            if extra:
                raise ValueError(
                    f"topology.workers_per_datacenter names {sorted(extra)} which are not in topology.datacenters"
                )

    def workers_in(self, dc: str) -> int | None:
        w = self.workers_per_datacenter
        if w is None or isinstance(w, int):
            return w
        return dict(w).get(dc)


@dataclass(frozen=True, kw_only=True)
class ParallelismRequest:
    """Model parallelism; ``None`` sizes mean "let the planner choose" (bounds: :class:`ParallelConfig`'s)."""

    tp: int | None = None
    """Tensor-parallel size (devices of one node that split every layer)."""
    pp: int | None = None
    """Pipeline stages (groups of layers, may span datacenters)."""
    schedule: PipelineSchedule = like(ParallelConfig, "schedule")
    """Pipeline schedule: ``1f1b``, ``gpipe`` or ``interleaved-1f1b``."""
    virtual_stages: int | None = None
    """Model chunks per pipeline rank (``interleaved-1f1b``); ``None``: the planner chooses."""
    sequence_parallel: bool | None = None
    """With tensor parallelism: norms and the residual stream sharded along the sequence; ``None``: on wherever
    tensor parallelism is."""
    stages_span_dcs: bool | None = None
    """Put pipeline stages in different datacenters (``True``), keep whole replicas inside one (``False``),
    or let the planner decide (``None``)."""

    def __post_init__(self) -> None:
        bounds_of(ParallelConfig, "tp").check("parallelism.tp", self.tp)
        bounds_of(ParallelConfig, "pp").check("parallelism.pp", self.pp)

    @property
    def is_data_parallel_only(self) -> bool:
        return self.tp == 1 and self.pp == 1


@dataclass(frozen=True, kw_only=True)
class DeclaredLink:
    """Inter-datacenter link figures given by the user instead of (or before) a probe."""

    a: str
    b: str
    rtt_ms: float = like(WanConfig, "rtt_ms")
    gbps: float = like(WanConfig, "gbps")

    def __post_init__(self) -> None:
        check_bounds(self, "topology.links.")
        if self.a == self.b:
            raise ValueError(f"topology.links: a link joins two different datacenters, got {[self.a, self.b]}")


@dataclass(frozen=True, kw_only=True)
class ResumeRequest:
    """The checkpoint a new job starts from: the newest of a finished job, or one named by its location."""

    job: str = ""
    """The id of an ended job (succeeded, failed or cancelled) of the same owner, whose newest checkpoint is read."""
    checkpoint: str = ""
    """A checkpoint folder (``<dir>/step-N``) or a job's checkpoint directory (its newest step is read): a path
    under the service's data roots, or a URL under its declared URL roots."""
    reset: tuple[ResetPart, ...] = ()
    """What this job starts afresh instead of continuing (a new phase)."""

    def __post_init__(self) -> None:
        if bool(self.job) == bool(self.checkpoint):
            raise ValueError("resume_from: name exactly one of resume_from.job and resume_from.checkpoint")
        if len(set(self.reset)) != len(self.reset):
            raise ValueError(f"resume_from.reset names a part twice: {[r.value for r in self.reset]}")


def _auto_sync() -> SyncConfig:
    return SyncConfig(strategy=None, bucket_mb=None)


@dataclass(frozen=True, kw_only=True)
class JobRequest:
    """A validated job submission, as the service receives it from the API. What it shares with
    :class:`TrainConfig` is declared there (defaults, bounds); the planner fills in the rest."""

    name: str
    model: ModelConfig
    data: DataConfig = like(TrainConfig, "data")
    optim: OptimConfig = like(TrainConfig, "optim")
    steps: int = like(TrainConfig, "steps")
    global_batch: int = like(TrainConfig, "global_batch")
    micro_batch: int = like(TrainConfig, "micro_batch")
    seed: int = like(TrainConfig, "seed")
    precision: Precision = Precision.AUTO
    """``auto`` (bf16 where the device supports it, else fp32), ``fp32`` or ``bf16``."""
    compile: bool = like(TrainConfig, "compile")
    activation_checkpointing: ActivationCheckpointing | None = None
    """Recomputation per block; ``None``: none where the layout fits in device memory, else the planner's."""
    topology: TopologyRequest = field(default_factory=TopologyRequest)
    parallelism: ParallelismRequest = field(default_factory=ParallelismRequest)
    links: tuple[DeclaredLink, ...] = ()
    """Declared inter-DC link figures (per DC pair) for the planner."""
    sync: SyncConfig = field(default_factory=_auto_sync)
    """The sync knobs; ``sync.strategy`` is the one place a job asks for a strategy: ``None`` (the default,
    "auto") lets the planner choose, and its choice is the plan's ``sync_strategy``. Likewise ``sync.bucket_mb``:
    ``None`` (the default) lets the planner size the gradient buckets (the plan's ``bucket_mb``)."""
    wan: WanConfig | None = like(TrainConfig, "wan")
    checkpoint_every: int = like(TrainConfig, "checkpoint_every")
    snapshot_every: int | None = None
    """Steps between the elastic ranks' state snapshots (a failure trains up to k - 1 steps again); ``None``
    ("auto", the default): every step while that is cheap, widened as measured where it is not (a GPU's
    multi-GB shard; ``TrainConfig.snapshot_adaptive``)."""
    validation: ValidationConfig | None = like(TrainConfig, "validation")
    tracking: TrackingConfig | None = like(TrainConfig, "tracking")
    keep_final: bool = True
    """Write the final step's weights to the job's storage (``checkpoints/<job id>/`` in the service's data
    dir), where ``GET /v1/jobs/{id}/artifacts`` lists them and ``meridian export`` reads them."""
    priority: int = knob(0, ge=-100, le=100, name="priority")
    """Higher runs first; FIFO within a priority."""
    owner: str = ""
    resume_from: ResumeRequest | None = None
    """Start from another job's checkpoint (weights, optimizer, schedule and data position) instead of step 0."""

    def __post_init__(self) -> None:
        check_batches(self)
        par = self.parallelism
        # "auto" sizes (None) are checked as 1, and what only a larger size allows is left to the plan
        fixed = ParallelConfig(tp=par.tp or 1, pp=par.pp or 1, schedule=par.schedule,
                               virtual_stages=(par.virtual_stages or (2 if PipelineSchedule(par.schedule).is_interleaved else 1))
                               if par.pp is not None else 1,
                               sequence_parallel=bool(par.sequence_parallel) and par.tp is not None)  # fmt: skip
        fixed.check_model(self.model)
        check_model_parallel_sync(fixed, self.sync)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the store keeps this)."""
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobRequest:
        """Read :meth:`to_dict`'s output, including that of earlier versions (a separate ``sync_strategy``)."""
        d = dict(d)
        if "sync_strategy" in d:
            # Before: the requested strategy (None = auto) had its own field and sync.strategy a placeholder.
            d["sync"] = {**(d.get("sync") or {}), "strategy": d.pop("sync_strategy")}
        return from_plain(cls, d)

