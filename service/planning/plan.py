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
    """Why the plan is what it is, at length: what it beat and why, what was rejected, the sync's reasoning."""
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
    bucket_mb: float | None = 4.0
    """Flat sync's DDP bucket size: the job's ``sync.bucket_mb``, or the planner's
    (:mod:`meridian.service.planning.buckets`) when the job left it out. ``None`` for every other strategy: the
    hierarchical engine syncs per FSDP2 unit, DiLoCo per fragment."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    stages_span_dcs: bool = False
    micro_batches: int = 1
    rank_nodes: tuple[str | None, ...] = ()
    """Node each rank is pinned to (tensor-parallel groups share a node); ``None``: any node of its DC."""
    micro_batch: int = 1
    """Samples per forward pass (the job's ``training.micro_batch``, or the planner's for an offline plan)."""
    virtual_stages: int = 1
    """Pipeline stages per device (interleaved 1F1B when > 1)."""
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    """Recomputation per block: ``none``, ``selective`` or ``full``."""
    fsdp_units: str = "block"
    """FSDP2's units: ``block`` (one per transformer block) or ``model`` (the whole model as one)."""
    reshard_after_forward: bool = True
    """FSDP frees each block's gathered weights after its forward (``False``: kept gathered through the step, one
    gather a step, where the device holds them: :attr:`~meridian.service.planning.cost_model.Layout.
    reshard_after_forward`)."""
    sharding: str = "none"
    """What each datacenter's ranks shard: ``fsdp`` (parameters, gradients and optimizer state), ``optimizer``
    (the optimizer state alone: a hierarchical layout the planner models without FSDP, on a runtime that lacks it)
    or ``none``."""
    plan_only: tuple[str, ...] = ()
    """The features the layout needs that the runtime lacks (:mod:`meridian.service.planning.runtime_support`):
    such a plan is shown, never run."""
    estimate: dict[str, float] = field(default_factory=dict)
    alternatives: tuple[dict[str, Any], ...] = ()
    summary: str = ""
    """The plan in at most eight lines (layout, memory per device, step estimate, throughput, inter-DC bytes,
    sync strategy and why): what ``meridian plan``, ``submit`` and ``demo`` print."""

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
                            "stages_span_dcs": self.stages_span_dcs, "micro_batches": self.micro_batches,
                            "micro_batch": self.micro_batch, "virtual_stages": self.virtual_stages,
                            "sequence_parallel": self.sequence_parallel,
                            "activation_checkpointing": self.activation_checkpointing, "sharding": self.sharding,
                            "fsdp_units": self.fsdp_units, "reshard_after_forward": self.reshard_after_forward},
            "plan_only": list(self.plan_only),
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
            "summary": self.summary,
            "explanation": self.explanation,
        }
