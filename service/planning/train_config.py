"""The one place a job's request and its plan become the :class:`TrainConfig` every rank trains with."""

from __future__ import annotations

from dataclasses import replace

from meridian.service.jobs import JobRequest
from meridian.service.planning.plan import Plan
from meridian.workers.contracts.config import (
    ActivationCheckpointing,
    FsdpUnits,
    ParallelConfig,
    PipelineSchedule,
    TrainConfig,
)


def build_train_config(job_id: str, request: JobRequest, plan: Plan, checkpoint_dir: str) -> TrainConfig:
    """The service → workers boundary: a frozen config with everything a rank needs. The request's own
    knobs pass through as they are; the plan supplies what the planner decided (placement, tp/pp, and the
    sync strategy with its DiLoCo knobs, its look-ahead, the gradient bucket size, the activation checkpointing, the
    virtual stages and sequence parallelism, which resolve a request's
    ``sync.strategy=None`` and ``sync.bucket_mb=None``). A knob of ``auto`` that only some strategies use is
    dropped where the plan did not pick one of them: ``sync.lookahead_after`` says when a look-ahead starts, and
    a plan without the look-ahead has none to start (the config would refuse it)."""
    armed = plan.lookahead_when_exposed if request.sync.strategy is None else request.sync.lookahead_when_exposed
    lookahead = request.sync.local_lookahead or plan.local_lookahead or armed is not None
    return TrainConfig(
        job_id=job_id, model=request.model, data=request.data, optim=request.optim,
        sync=replace(request.sync, strategy=plan.sync_strategy, diloco=plan.diloco, bucket_mb=plan.bucket_mb,
                     compression=plan.compression or request.sync.compression,
                     delay_one_step=request.sync.delay_one_step or lookahead, local_lookahead=lookahead,
                     lookahead_after=request.sync.lookahead_after if lookahead else None,
                     lookahead_when_exposed=armed if lookahead else None), wan=request.wan,
        steps=request.steps, global_batch=request.global_batch, micro_batch=request.micro_batch,
        seed=request.seed, precision=request.precision, compile=request.compile,
        activation_checkpointing=ActivationCheckpointing(plan.activation_checkpointing), checkpoint_every=request.checkpoint_every,
        snapshot_every=request.snapshot_every or 1, snapshot_adaptive=request.snapshot_every is None,
        checkpoint_dir=checkpoint_dir, datacenters=plan.rank_datacenters,
        parallel=ParallelConfig(tp=plan.tp, pp=plan.pp, schedule=PipelineSchedule(plan.schedule),
                                virtual_stages=plan.virtual_stages if plan.pp > 1 else 1,
                                sequence_parallel=plan.sequence_parallel and plan.tp > 1,
                                reshard_after_forward=plan.reshard_after_forward,
                                fsdp_units=FsdpUnits(plan.fsdp_units)),
        validation=request.validation,
    )
