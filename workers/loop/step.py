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
from meridian.workers.loop.replica import Batches, Replica
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


class BatchPrefetch:
    """On CUDA: each step's batches in pinned memory, copied to the device on a side stream while the step
    before runs (:func:`timed_step` asks for step ``n + 1`` once step ``n``'s backward is queued). The CPU
    path does not use it: there the batches are read when the step starts, as ever."""

    def __init__(self, data: Dataset, cfg: TrainConfig, replica: Replica) -> None:
        self.data, self.cfg, self.replica = data, cfg, replica
        self.device = replica.device
        self.stream = torch.cuda.Stream(device=self.device)
        self._next: tuple[int, Batches] | None = None

    @classmethod
    def for_replica(cls, data: Dataset, cfg: TrainConfig, replica: Replica) -> BatchPrefetch | None:
        return cls(data, cfg, replica) if replica.device.type == "cuda" else None

    def _host(self, step: int) -> Batches:
        r = self.replica
        return self.data.step_batches(step + self.cfg.data_offset, self.cfg.global_batch, self.cfg.micro_batch,
                                      r.data_rank, r.data_world, uniform=r.uniform_micro_batches)

    def start(self, step: int) -> None:
        """Read step ``step``'s batches, pin them and queue their copies to the device (no host sync)."""
        if step >= self.cfg.steps:
            return
        host = [(x.pin_memory(), y.pin_memory()) for x, y in self._host(step)]
        with torch.cuda.stream(self.stream):
            moved = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in host]
        self._next = (step, moved)

    def take(self, step: int) -> Batches:
        """Step ``step``'s batches on the device, ready for the current stream to use."""
        if self._next is None or self._next[0] != step:
            self.start(step)  # the epoch's first step, or a step out of order: copy it now
        assert self._next is not None
        _, moved = self._next
        self._next = None
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for x, y in moved:  # allocated on the side stream, used on this one: keep the allocator from reusing
            x.record_stream(current)
            y.record_stream(current)
        return moved


def timed_step(
    replica: Replica, data: Dataset, cfg: TrainConfig, step: int,
    rank_step: Callable[[dict[str, Any]], None] | None = None, *, snapshot: bool = False,
    prefetch: BatchPrefetch | None = None,
) -> StepOutput:
    """Optimizer step ``step`` (0-based) on this rank. ``rank_step`` receives the heartbeats: "computed"
    when forward and backward are done (before the optimizer step waits for the gradient sync, so a rank
    blocked on its peers has said so and a rank that stalled has not), "done" after the update. With
    ``prefetch`` (CUDA) the batches were copied during the step before, and step ``step + 1``'s are queued
    once this step's backward is."""
    assert replica.engine is not None
    rank = replica.m.rank
    t0 = time.perf_counter()
    if prefetch is not None:
        batches = prefetch.take(step)
    else:
        # (a job resumed with its schedule or its data reset trains the batch of another position than its step)
        batches = data.step_batches(step + cfg.data_offset, cfg.global_batch, cfg.micro_batch, replica.data_rank,
                                    replica.data_world, uniform=replica.uniform_micro_batches)
    data_s = time.perf_counter() - t0
    loss = replica.forward_backward(batches)
    if prefetch is not None:  # the GPU runs this step's kernels while the host reads and pins the next batch
        t1 = time.perf_counter()
        prefetch.start(step + 1)
        data_s += time.perf_counter() - t1
    if rank_step is not None:
        rank_step(computed_beat(rank, step + 1))
    stats = replica.engine.step(lr_at(step, cfg), snapshot_as=step + 1 if snapshot else None,
                                last=step + 1 == cfg.steps)
    step_s = time.perf_counter() - t0
    if rank_step is not None:
        rank_step(heartbeat(rank, step + 1, StepTimes(step_s, data_s, stats.sync_wait_s)))
    inter_dc = stats.inter_dc_bytes + replica.extra_inter_dc_bytes()
    return StepOutput(loss=loss, stats=stats, step_s=step_s, data_s=data_s, inter_dc_bytes=inter_dc)
