"""What the planner reads of a job: its model's shape and the knobs that shape a layout.

The service plans a :class:`~meridian.service.jobs.JobRequest` (:meth:`PlanRequest.of`); ``meridian plan
--cluster`` plans a spec whose model may be one this runtime cannot build (a Hugging Face ``config.json`` of any
supported ``model_type``), so the planner never reads a ``ModelConfig``, only its
:class:`~meridian.workers.contracts.model_shape.ModelShape`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meridian.service.jobs import JobRequest, ParallelismRequest, TopologyRequest
from meridian.service.planning.cost_model import Recompute
from meridian.workers.contracts.config import Precision, SyncConfig
from meridian.workers.contracts.model_shape import ModelShape


def _auto_sync() -> SyncConfig:
    return SyncConfig(strategy=None, bucket_mb=None)


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """A job as the planner sees it."""

    shape: ModelShape
    global_batch: int
    micro_batch: int | None
    """Samples per forward pass; ``None``: the planner searches it (offline plans only; a job fixes it)."""
    steps: int
    precision: Precision = Precision.AUTO
    topology: TopologyRequest = field(default_factory=TopologyRequest)
    parallelism: ParallelismRequest = field(default_factory=ParallelismRequest)
    sync: SyncConfig = field(default_factory=_auto_sync)
    warmup_steps: int = 0
    """The optimizer's warm-up steps (when the look-ahead may start)."""
    checkpoint_every: int = 0
    """Steps between periodic checkpoints (0: none); only data-parallel layouts write resumable ones."""
    recompute: Recompute | None = None
    """Activation recomputation per block; ``None``: the least that fits (none where the runtime has none)."""

    def __post_init__(self) -> None:
        if self.micro_batch is not None and self.micro_batch > self.global_batch:
            raise ValueError(f"training.micro_batch ({self.micro_batch}) must be <= training.global_batch "
                             f"({self.global_batch})")

    @classmethod
    def of(cls, job: JobRequest) -> PlanRequest:
        return cls(shape=ModelShape.of(job.model), global_batch=job.global_batch, micro_batch=job.micro_batch,
                   steps=job.steps, precision=job.precision, topology=job.topology, parallelism=job.parallelism,
                   sync=job.sync, warmup_steps=job.optim.warmup_steps, checkpoint_every=job.checkpoint_every,
                   recompute=None if job.activation_checkpointing is None else Recompute(job.activation_checkpointing.value))


def plan_request(request: JobRequest | PlanRequest) -> PlanRequest:
    """``request`` as the planner reads it."""
    return request if isinstance(request, PlanRequest) else PlanRequest.of(request)
