"""The plan of a job, as one frozen value: where each rank runs, how it syncs, and why.

Made by the planner (:func:`meridian.service.planning.planner.plan_job`), stored and served as
:meth:`Plan.to_dict` (the only place it becomes a dict: the store and the API speak JSON), and handed to
the job's runner actor as itself (Ray pickles a dataclass). Plain data: it must never import Ray, torch or
the planner's search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meridian.workers.contracts.config import Compression, DiLoCoConfig, SyncStrategy
from meridian.workers.contracts.fields import to_plain


@dataclass(frozen=True)
class Plan:
    datacenters: tuple[str, ...]
    """Datacenters used, in rank order."""
    rank_datacenters: tuple[str, ...]
    """Datacenter of each world rank."""
    use_gpu: bool
    sync_strategy: SyncStrategy
    """The planner's choice: the job's ``sync.strategy`` when it asked for one, else the fastest; the
    TrainConfig's ``sync.strategy`` is this (:func:`~meridian.service.planning.train_config.build_train_config`)."""
    explanation: str
    diloco: DiLoCoConfig | None = None
    """H, fragments, overlap when ``sync_strategy`` is a DiLoCo one (:mod:`meridian.service.planning.sync_choice`)."""
    compression: Compression | None = None
    """The inter-DC encoding the planner chose with an ``auto`` DiLoCo pick (4-bit outer deltas); ``None``
    keeps the request's ``sync.compression``."""
    local_lookahead: bool = False
    """The planner chose per-step sync applied one step late at a local look-ahead (``sync.delay_one_step`` and
    ``sync.local_lookahead``, :mod:`meridian.service.planning.sync_choice`)."""
    lookahead_when_exposed: float | None = None
    """The look-ahead is armed (``sync.lookahead_when_exposed``): the job's own steps decide whether it takes
    over. ``auto`` arms it on exact per-step sync it chose on figures nobody measured, or where the job asked."""
    bucket_mb: float = 4.0
    """The gradient bucket size every rank uses: the job's ``sync.bucket_mb``, or the planner's
    (:mod:`meridian.service.planning.buckets`) when the job left it out."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    stages_span_dcs: bool = False
    micro_batches: int = 1
    rank_nodes: tuple[str | None, ...] = ()
    """Node each rank is pinned to (tensor-parallel groups share a node); ``None``: any node of its DC."""
    estimate: dict[str, float] = field(default_factory=dict)
    alternatives: tuple[dict[str, Any], ...] = ()

    @property
    def num_workers(self) -> int:
        return len(self.rank_datacenters)

    @property
    def dp(self) -> int:
        return self.num_workers // (self.tp * self.pp)

    def workers_in(self, dc: str) -> int:
        return self.rank_datacenters.count(dc)

    def to_dict(self) -> dict[str, Any]:
        return {
            "datacenters": list(self.datacenters),
            "workers_per_datacenter": {dc: self.workers_in(dc) for dc in self.datacenters},
            "num_workers": self.num_workers,
            "rank_datacenters": list(self.rank_datacenters),
            "rank_nodes": list(self.rank_nodes) if self.rank_nodes else [None] * self.num_workers,
            "parallelism": {"tp": self.tp, "pp": self.pp, "dp": self.dp, "schedule": self.schedule,
                            "stages_span_dcs": self.stages_span_dcs, "micro_batches": self.micro_batches},
            "use_gpu": self.use_gpu,
            "resources_per_worker": self.resources_per_worker,
            "sync_strategy": self.sync_strategy.value,
            "diloco": None if self.diloco is None else to_plain(self.diloco),
            "compression": None if self.compression is None else self.compression.value,
            "local_lookahead": self.local_lookahead,
            "lookahead_when_exposed": self.lookahead_when_exposed,
            "bucket_mb": self.bucket_mb,
            "estimate": self.estimate,
            "alternatives": list(self.alternatives),
            "explanation": self.explanation,
        }
