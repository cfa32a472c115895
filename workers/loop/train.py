"""The training loop every rank runs, with no knowledge of Ray: one loop for every kind of job.

One call of :meth:`TrainingLoop.run_epoch` trains one *epoch*, one membership of the job::

    build   this rank's replica for the epoch's layout: groups, model or stage, WAN emulator(s), sync engine
            (:mod:`meridian.workers.loop.replica`; tensor/pipeline parallelism: :mod:`meridian.workers.loop.parallel`)
    restore the state the epoch starts from (an elastic run's :class:`EpochState`; otherwise step 0)
    steps   :func:`meridian.workers.loop.step.timed_step` until the last step, or until every rank agrees to
            leave at a step boundary (a newcomer waits to join); rank 0 reports each step as a
            :class:`~meridian.workers.contracts.records.StepRecord` through a :class:`ProgressSink`
    finish  the final checkpoint (elastic), evaluate (skipped, with the reason in the result, when the held-out
            split has no sample), the :class:`TrainResult`
    close   the replica's one clean-up path, on success and on error alike

Plain training — :func:`train`, used by the tests and the benchmarks — is that loop for one epoch over the
existing default process group, without a rendezvous. The elastic trainer
(:mod:`meridian.workers.elastic.trainer`) runs it once per epoch it joins, with an :class:`EpochState` that
snapshots, checkpoints and restores. The process group must already exist: the elastic rendezvous, the
multi-process test harness or a benchmark creates it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.records import TrainResult
from meridian.workers.data.shards import Dataset
from meridian.workers.data.text import TooFewTokens
from meridian.workers.loop import prepared
from meridian.workers.loop.observe import DevicePeak, measure_peak_flops
from meridian.workers.loop.parallel import ModelParallelReplica
from meridian.workers.loop.records import ListSink, ProgressSink, step_record
from meridian.workers.loop.replica import DataParallelReplica, Membership, Replica
from meridian.workers.loop.report import ReportWindows, StepReport
from meridian.workers.loop.step import BatchPrefetch, timed_step
from meridian.workers.state.replica_state import LocalShard

__all__ = ["EpochOutcome", "EpochState", "ListSink", "Membership", "ProgressSink", "TrainResult", "TrainingLoop",
           "train"]  # fmt: skip


class EpochState(Protocol):
    """What an elastic run keeps across epochs; the loop calls it at fixed points of every epoch."""

    def restore(self, replica: Replica) -> int:
        """Load the state the epoch starts from into the built replica; returns the step to train next."""
        ...

    def keep(self, shard: LocalShard) -> None:
        """This rank's shard of the state after a step (taken before the parameter all-gather)."""
        ...

    def leave_requested(self) -> bool:
        """Whether this rank asks every rank to leave the epoch at the next step boundary."""
        ...

    def snapshot_cost(self) -> tuple[float, float]:
        """(seconds a snapshot holds the loop up, seconds its background write takes), as measured so far."""
        ...

    def snapshots_widened(self, every: int, loop_s: float, background_s: float, step_s: float) -> None:
        """Every rank now snapshots every ``every`` steps, for the costs and step time given (the means of the ranks)."""
        ...

    def step_done(self, replica: Replica, steps_done: int) -> None:
        """After each step, on every rank (a durable checkpoint when one is due)."""
        ...

    def finish(self, replica: Replica) -> None:
        """After the last step, before the result (the final durable checkpoint)."""
        ...


@dataclass
class EpochOutcome:
    finished: bool
    """The job's last step is done (else every rank left at a step boundary to re-form)."""
    result: TrainResult | None = None


def build_replica(cfg: TrainConfig, membership: Membership, device: torch.device) -> Replica:
    """The replica a job's parallelism asks for (built by :meth:`Replica.build`, inside the loop's clean-up)."""
    kind = ModelParallelReplica if cfg.parallel.model_parallel > 1 else DataParallelReplica
    return kind(cfg, membership, device)


class TrainingLoop:
    """One rank's training, epoch after epoch. ``on_failure`` sees an error before the clean-up runs (the
    elastic agent's child shuts its TCP connections down there, or leaves the process on a GPU: gloo cannot abort
    a collective in flight, and the clean-up would wait for one)."""

    def __init__(
        self, cfg: TrainConfig, *, sink: ProgressSink, device: torch.device | None = None, keep_params: bool = False,
        on_failure: Callable[[Exception], None] | None = None, peak: DevicePeak | None = None,
        on_peak: Callable[[DevicePeak], None] | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.sink = sink
        self.device = device or torch.device("cpu")
        self.keep_params = keep_params
        self.on_failure = on_failure
        self._peak: DevicePeak | None = peak
        """Measured by an earlier training process of this worker, if any: a re-formed epoch's first step
        does not wait for rank 0 to measure it again."""
        self.on_peak = on_peak
        self._data: dict[str, Dataset] = {}
        """The job's datasets by split, made once for every epoch of this process (read-only)."""

    def data(self, split: str = "train") -> Dataset:
        if split not in self._data:
            cfg = self.cfg
            self._data[split] = prepared.dataset(cfg.data, cfg.model.seq_len, cfg.seed, split)
        return self._data[split]

    def run_epoch(self, membership: Membership, state: EpochState | None = None) -> EpochOutcome:
        """Train ``membership``'s epoch on this rank; every rank of the epoch's default group must call it."""
        # Before the ranks meet in the replica's first collectives: measured later, rank 0's first steps would lag
        # the others' and they would wait for it inside the training loop (bench lowcomm: 0.3 s of a 16 s loop).
        self._device_peak(membership.rank)
        replica = build_replica(self.cfg, membership, self.device)
        ok = False
        try:
            replica.build()
            start = state.restore(replica) if state is not None else 0
            outcome = self._train(replica, start, state)
            ok = True
            return outcome
        except Exception as e:
            if self.on_failure is not None:
                self.on_failure(e)
            raise
        finally:
            replica.close(ok=ok)

    def _device_peak(self, rank: int) -> DevicePeak | None:
        """Rank 0's device peak, the MFU's denominator: measured once, when the sink takes heartbeats (the
        service's); a sink without them (tests, benchmarks) does not pay for the measurement."""
        if self._peak is None and rank == 0 and getattr(self.sink, "rank_step", None) is not None:
            self._peak = measure_peak_flops(self.device)
            if self.on_peak is not None:
                self.on_peak(self._peak)
        return self._peak if rank == 0 else None

    def _train(self, replica: Replica, start: int, state: EpochState | None) -> EpochOutcome:
        cfg, m, sink = self.cfg, replica.m, self.sink
        assert replica.engine is not None
        data = self.data()
        val_data = self.data("eval") if cfg.validation else None
        # Per-rank heartbeats go out of band (not through a collective), so the service can name a rank that
        # stopped finishing steps even while every other rank sits blocked in the collective waiting for it.
        rank_step = getattr(sink, "rank_step", None)
        peak = self._device_peak(m.rank)
        first_loss = final_loss = math.nan
        timed_tokens, timed_s, inter_dc_total, steps_here = 0, 0.0, 0, 0
        # Every rank starts the epoch at the same cadence: the job's, or an adaptive job's widest so far (the
        # rendezvous hands it to survivors and newcomers alike), then widens it as measured
        first = max(cfg.snapshot_every, m.snapshot_every) if cfg.snapshot_adaptive else cfg.snapshot_every
        reports = ReportWindows(replica.device, m.world_size, min_window_steps=report_window_steps(cfg, m),
                                snapshot_every=first, adaptive_snapshots=cfg.snapshot_adaptive and state is not None)
        prefetch = BatchPrefetch.for_replica(data, cfg, replica)  # CUDA: pinned, one step ahead; CPU: None

        def publish(rows: list[StepReport]) -> None:
            # Each step's global loss is summed a window of steps at a time and read a window later, so
            # reporting it never puts a latency round on the critical path, over a LAN or a far link.
            nonlocal first_loss, final_loss
            for r in rows:
                assert r.stats is not None
                first_loss = r.loss if math.isnan(first_loss) else first_loss
                final_loss = r.loss
                if m.rank == 0:
                    sink.step(step_record(cfg, r.step, r.loss, r.out.step_s, r.stats, r.inter_dc_bytes, r.done_at,
                                          data_s=r.out.data_s, peak=peak, world=m.world_size, epoch=m.epoch,
                                          val_loss=r.val_loss))

        step = start
        while step < cfg.steps:
            started = time.perf_counter()
            # Every k steps (the recovery promise: up to k - 1 steps trained again); every rank has the same k.
            snap = state is not None and (step + 1) % reports.snapshot_every == 0
            out = timed_step(replica, data, cfg, step, rank_step, snapshot=snap, prefetch=prefetch)
            snapshot = None
            if snap:
                assert state is not None and out.stats.shard is not None
                began = time.perf_counter()
                state.keep(out.stats.shard)
                snapshot = (state.snapshot_cost(), time.perf_counter() - began)
            dev = replica.device
            contrib = out.loss if replica.reports_loss else torch.zeros((), device=dev)
            publish(reports.add(step, out, contrib, leave=state is not None and state.leave_requested(),
                                snapshot=snapshot))
            if reports.snapshots_widened is not None:
                assert state is not None
                state.snapshots_widened(*reports.snapshots_widened)
                reports.snapshots_widened = None
            if steps_here > 0:  # the epoch's first step pays for warm-up: not timed
                timed_tokens += cfg.tokens_per_step
                # On CUDA the step only queues kernels; the loop is paced where a window's sum is read, so the
                # whole iteration is the step's time there.
                timed_s += time.perf_counter() - started if dev.type == "cuda" else out.step_s
            steps_here += 1
            inter_dc_total += out.inter_dc_bytes
            step += 1
            if cfg.validation is not None and (step % cfg.validation.every_steps == 0 or step == cfg.steps):
                assert val_data is not None
                replica.engine.synchronize()  # every rank evaluates at the same step (pipelines all-reduce)
                reports.set_val_loss(replica.evaluate(val_data, batches=cfg.validation.batches))
            if state is not None:
                state.step_done(replica, step)
            if reports.leave and step < cfg.steps:
                publish(reports.flush())
                if state is not None and not snap:  # the next epoch resumes here: nothing to train again
                    replica.engine.synchronize()
                    state.keep(replica.engine.local_shard(step))
                return EpochOutcome(finished=False)  # a newcomer joins at this step boundary

        publish(reports.flush())
        replica.engine.synchronize()
        if state is not None:  # the trained run is kept before anything else can fail
            state.finish(replica)
        eval_loss, eval_skipped = self._final_evaluation(replica, val_data)
        final_params = replica.parameters() if self.keep_params else None
        totals = torch.tensor([float(inter_dc_total)])
        dist.all_reduce(totals)
        result = TrainResult(
            first_loss=first_loss, final_loss=final_loss, eval_loss=eval_loss, steps=cfg.steps,
            tokens_per_s=timed_tokens / timed_s if timed_s else 0.0,
            inter_dc_bytes_per_step=totals.item() / max(1, steps_here),
            optimizer_state_bytes=replica.engine.optimizer_state_nbytes(), final_params=final_params,
            eval_skipped=eval_skipped,
        )  # fmt: skip
        return EpochOutcome(finished=True, result=result)

    def _final_evaluation(self, replica: Replica, val_data: Dataset | None) -> tuple[float | None, str]:
        """``(held-out loss, "")``, or ``(None, why)`` when the held-out split cannot give one sample: a job
        without ``validation`` is admitted whatever its split holds (``--val-fraction 0``, a short text), and
        its trained steps must not be lost to the loss it was only to report. Every rank reads the same split,
        so all of them evaluate or all skip."""
        try:
            data = val_data or self.data("eval")
        except TooFewTokens as e:
            return None, f"final evaluation skipped: {e}"
        return replica.evaluate(data), ""


def report_window_steps(cfg: TrainConfig, m: Membership) -> int:
    """The fewest steps a window of the loop's sums spans: a DiLoCo job's outer cycle when it spans datacenters
    (its sums then cross them as often as its weights do, :class:`ReportWindows`), else one."""
    strategy = cfg.sync.strategy
    if strategy is not None and strategy.is_diloco and len(set(m.datacenters)) > 1:
        return cfg.sync.outer.inner_steps
    return 1


def train(
    cfg: TrainConfig, *, sink: ProgressSink, device: torch.device | None = None, keep_params: bool = False
) -> TrainResult:
    """Run the job on this rank: the one loop for one epoch without a rendezvous, over the default process
    group. Every rank of that group must call it."""
    loop = TrainingLoop(cfg, sink=sink, device=device, keep_params=keep_params)
    outcome = loop.run_epoch(Membership.of_default_group(cfg))
    assert outcome.result is not None
    return outcome.result
