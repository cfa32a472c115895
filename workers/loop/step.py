"""One optimizer step on this rank, whatever the job's parallelism: read the step's batches, forward and
backward through the replica, sync and update through the engine, with the per-rank heartbeats around it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.data.shards import Dataset
from meridian.workers.loop.observe import StepTimes, computed_beat, heartbeat
from meridian.workers.loop.replica import Replica
from meridian.workers.loop.schedule import lr_at
from meridian.workers.sync.engine import StepStats


@dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor
    """This rank's share of the step's global mean loss (0 on a rank that does not report it)."""
    stats: StepStats
    """The engine's stats, with this rank's shard of the new state when the step was asked to snapshot."""
    step_s: float
    data_s: float
    """Of ``step_s``: seconds spent producing the batches (the data loader's share)."""
    inter_dc_bytes: int
    """Bytes this rank put into inter-DC collectives and pipeline messages this step."""


def timed_step(
    replica: Replica, data: Dataset, cfg: TrainConfig, step: int,
    rank_step: Callable[[dict[str, Any]], None] | None = None, *, snapshot: bool = False,
) -> StepOutput:
    """Optimizer step ``step`` (0-based) on this rank. ``rank_step`` receives the heartbeats: "computed"
    when forward and backward are done (before the optimizer step waits for the gradient sync, so a rank
    blocked on its peers has said so and a rank that stalled has not), "done" after the update."""
    assert replica.engine is not None
    rank = replica.m.rank
    t0 = time.perf_counter()
    batches = data.step_batches(step, cfg.global_batch, cfg.micro_batch, replica.data_rank, replica.data_world)
    data_s = time.perf_counter() - t0
    loss = replica.forward_backward(batches)
    if rank_step is not None:
        rank_step(computed_beat(rank, step + 1))
    stats = replica.engine.step(lr_at(step, cfg), snapshot_as=step + 1 if snapshot else None)
    step_s = time.perf_counter() - t0
    if rank_step is not None:
        rank_step(heartbeat(rank, step + 1, StepTimes(step_s, data_s, stats.sync_wait_s)))
    inter_dc = stats.inter_dc_bytes + replica.extra_inter_dc_bytes()
    return StepOutput(loss=loss, stats=stats, step_s=step_s, data_s=data_s, inter_dc_bytes=inter_dc)
