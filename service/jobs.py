"""Jobs as the control plane sees them: what was asked (:class:`JobRequest`), where a job is in its life
(:class:`JobState`, :class:`JobStatus`), and the one function that moves it (:func:`transition`).

States know whether they are terminal and carry why they are where they are (``reason`` + ``message``,
as Kueue and Slurm do for pending jobs). Strings appear only in the store and on the wire.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

from meridian.service.errors import InvalidTransition
from meridian.workers.contracts.config import (
    Compression,
    DataConfig,
    DiLoCoConfig,
    ModelConfig,
    OptimConfig,
    SyncConfig,
    SyncStrategy,
    WanConfig,
    to_plain,
)


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
    JobState.RUNNING: {JobState.PLACING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED},
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


@dataclass(frozen=True, kw_only=True)
class TopologyRequest:
    """Where the job should run. ``None`` fields mean "let the planner choose" (``auto``)."""

    datacenters: tuple[str, ...] | None = None
    """Datacenters to use, in order; ``None`` = every datacenter with capacity."""
    workers_per_datacenter: int | tuple[tuple[str, int], ...] | None = None
    """Workers in each datacenter (one number for all, or per name); ``None`` = as many as fit."""
    min_workers: int = 1
    """Below this many live workers the job waits for capacity instead of training."""

    def workers_in(self, dc: str) -> int | None:
        w = self.workers_per_datacenter
        if w is None or isinstance(w, int):
            return w
        return dict(w).get(dc)


@dataclass(frozen=True, kw_only=True)
class ParallelismRequest:
    """Model parallelism; ``None`` sizes mean "let the planner choose"."""

    tp: int | None = None
    """Tensor-parallel size (devices of one node that split every layer)."""
    pp: int | None = None
    """Pipeline stages (groups of layers, may span datacenters)."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b`` or ``gpipe``."""
    stages_span_dcs: bool | None = None
    """Put pipeline stages in different datacenters (``True``), keep whole replicas inside one (``False``),
    or let the planner decide (``None``)."""

    @property
    def is_data_parallel_only(self) -> bool:
        return self.tp == 1 and self.pp == 1


@dataclass(frozen=True, kw_only=True)
class DeclaredLink:
    """Inter-datacenter link figures given by the user instead of (or before) a probe."""

    a: str
    b: str
    rtt_ms: float
    gbps: float


@dataclass(frozen=True, kw_only=True)
class JobRequest:
    """A validated job submission, as the service receives it from the API."""

    name: str
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int
    global_batch: int
    micro_batch: int
    seed: int = 0
    precision: str = "auto"
    """``auto`` (bf16 where the device supports it, else fp32), ``fp32`` or ``bf16``."""
    topology: TopologyRequest = field(default_factory=TopologyRequest)
    parallelism: ParallelismRequest = field(default_factory=ParallelismRequest)
    links: tuple[DeclaredLink, ...] = ()
    """Declared inter-DC link figures (per DC pair) for the planner."""
    sync_strategy: SyncStrategy | None = None
    """``None`` = auto: hierarchical across datacenters, flat inside one."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    wan: WanConfig | None = None
    checkpoint_every: int = 0
    priority: int = 0
    owner: str = ""

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobRequest:
        topo = d.get("topology") or {}
        w = topo.get("workers_per_datacenter")
        if isinstance(w, list):
            w = tuple((str(k), int(v)) for k, v in w)
        elif isinstance(w, dict):
            w = tuple((str(k), int(v)) for k, v in w.items())
        sync = dict(d.get("sync") or {})
        sync["strategy"] = SyncStrategy(sync.get("strategy", "hierarchical"))
        sync["compression"] = Compression(sync.get("compression", "none"))
        sync["diloco"] = DiLoCoConfig(**sync["diloco"]) if sync.get("diloco") else None
        return cls(
            name=d["name"],
            model=ModelConfig(**d["model"]),
            data=DataConfig(**(d.get("data") or {})),
            optim=OptimConfig(**(d.get("optim") or {})),
            steps=d["steps"], global_batch=d["global_batch"], micro_batch=d["micro_batch"],
            seed=d.get("seed", 0), precision=d.get("precision", "auto"),
            topology=TopologyRequest(
                datacenters=tuple(topo["datacenters"]) if topo.get("datacenters") is not None else None,
                workers_per_datacenter=w,
                min_workers=topo.get("min_workers", 1),
            ),
            parallelism=ParallelismRequest(**(d.get("parallelism") or {})),
            links=tuple(DeclaredLink(**link) for link in d.get("links") or ()),
            sync_strategy=SyncStrategy(d["sync_strategy"]) if d.get("sync_strategy") else None,
            sync=SyncConfig(**sync),
            wan=WanConfig(**d["wan"]) if d.get("wan") else None,
            checkpoint_every=d.get("checkpoint_every", 0),
            priority=d.get("priority", 0),
            owner=d.get("owner", ""),
        )

    def with_owner(self, owner: str) -> JobRequest:
        return replace(self, owner=owner)
