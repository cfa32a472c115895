"""The training loop of a job that survives losing nodes: join an epoch, train, and on a peer's failure
re-form over the survivors and resume from memory.

One *epoch* is one membership: its ranks, its process groups, its sync engine. Every rank runs::

    join → form the process group → build model, engine, WAN emulator for this epoch's layout
         → restore: pool the survivors' in-memory shards of the step they all completed
                    (:mod:`meridian.workers.state.replica_state`), or the durable checkpoint if they cannot cover
                    the whole state, or nothing on a first start
         → train, snapshotting this rank's shard after every step (before the parameter all-gather)
    a collective fails  → tear down every group (so blocked peers fail fast too) → join again
    a newcomer waits    → every rank leaves after the same step (the flag rides on the stats all-reduce)
                          → join again; the newcomer receives the state from the pooled shards

The data order depends only on the step and the global batch (:meth:`TextDataset.step_batches`), so a
resized epoch trains on exactly the samples the old one would have: none skipped, none seen twice.
No Ray here: the coordinator is reached through :class:`meridian.workers.elastic.rendezvous.Rendezvous`.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.data.text import TextDataset
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.elastic.protocol import KEEP_SNAPSHOTS, RESTART_EXIT_CODE
from meridian.workers.elastic.rendezvous import Assignment, JobFinished, Rendezvous
from meridian.workers.loop.observe import measure_peak_flops
from meridian.workers.loop.train import (
    ProgressSink,
    TrainResult,
    evaluate,
    progress_record,
    timed_step,
    train,
)
from meridian.workers.model.gpt import GPT
from meridian.workers.state import checkpoint as ckpt_io
from meridian.workers.state.replica_state import IncompleteState, LocalShard, assemble
from meridian.workers.state.snapshots import SnapshotStore
from meridian.workers.sync.build import GradientSync, build_sync
from meridian.workers.wan.collectives import WanEmulator, agree_key, cleanup

EventFn = Callable[[str, str, dict[str, Any]], None]

_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "Socket Timeout",
    "Timed out",
    "timed out",
    "NCCL",
    "gloo",
    "Gloo",
    "process group",
)


def is_peer_failure(error: BaseException) -> bool:
    """A collective failed because a peer went away (as opposed to a bug in this rank's own work)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _PEER_FAILURE_MARKERS)


class PendingChangeWatch:
    """Rank 0 asks the coordinator, off the training thread, whether a newcomer waits to join."""

    def __init__(self, rendezvous: Rendezvous, period_s: float = 0.5) -> None:
        self.rendezvous, self.period_s = rendezvous, period_s
        self.flag = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meridian-pending-change", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                if self.rendezvous.pending_change():
                    self.flag.set()
            except Exception:  # noqa: BLE001 - the coordinator being slow must never stop training
                continue

    def close(self) -> None:
        self._stop.set()


@dataclass
class EpochOutcome:
    finished: bool
    result: TrainResult | None = None


def fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint must share with the job to resume it."""
    m = cfg.model
    return {"model": [m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size], "global_batch": cfg.global_batch,
            "seed": cfg.seed, "data": cfg.data.source}  # fmt: skip


class ModelParallelNotElastic(RuntimeError):
    """A tensor/pipeline-parallel job lost a worker: it cannot re-form (yet)."""


class ElasticTrainer:
    """One rank of an elastic job; :meth:`run` returns when the job's last step is done."""

    def __init__(
        self, cfg: TrainConfig, rendezvous: Rendezvous, *, sink: ProgressSink, on_event: EventFn,
        device: torch.device | None = None, join_timeout_s: float = 600.0, snapshots: SnapshotStore | None = None,
        exit_on_failure: bool = False, on_epoch: Callable[[int], None] | None = None, keep_params: bool = False,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.rdzv = rendezvous
        self.sink = sink
        self.on_event = on_event
        self.device = device or torch.device("cpu")
        self.join_timeout_s = join_timeout_s
        self.snapshots = snapshots or SnapshotStore(KEEP_SNAPSHOTS)
        self.exit_on_failure = exit_on_failure
        """Leave the process on a peer's failure (:mod:`meridian.workers.elastic.agent` starts a new one): the only way
        to close sockets that gloo operations still in flight hold open."""
        self.on_epoch = on_epoch or (lambda n: None)
        self.keep_params = keep_params
        self.epochs = 0
        self.recoveries = 0
        self._writer: threading.Thread | None = None
        self._peak = None
        self.final_params: dict[str, torch.Tensor] = {}
        """The parameters after the last step (CPU copies)."""

    def run(self) -> TrainResult | None:
        """Train to the last step; ``None`` when the job finished without this worker (it joined too late)."""
        while True:
            try:
                a = self.rdzv.join(last_step=self.snapshots.last_step, timeout_s=self.join_timeout_s)
            except JobFinished:
                return None
            self.epochs += 1
            self.on_epoch(a.epoch)
            try:
                outcome = self._run_epoch(a)
            except Exception as e:
                if not is_peer_failure(e):
                    raise
                self.recoveries += 1
                Rendezvous.teardown()
                continue
            Rendezvous.teardown()
            if outcome.finished:
                assert outcome.result is not None
                self._wait_writer()
                self.rdzv.finish()
                return outcome.result

    # -- one epoch ----------------------------------------------------------------------------------------
    def _run_epoch(self, a: Assignment) -> EpochOutcome:
        cfg, device = self.cfg, self.device
        emulator = engine = groups = watch = None
        ok = False
        try:
            self.rdzv.form(a)
            if cfg.parallel.model_parallel > 1:
                return self._run_model_parallel(a)
            layout = DCLayout(a.datacenters)
            groups = DCGroups(layout, a.rank)
            torch.manual_seed(cfg.seed)
            model = GPT(cfg.model).to(device)
            if cfg.wan is not None and layout.num_dcs > 1:
                emulator = WanEmulator(cfg.wan, layout, a.rank, key=agree_key(f"job-{cfg.job_id}-e{a.epoch}"))
            engine = build_sync(model, groups, cfg.sync, cfg.optim, emulator=emulator)
            watch = PendingChangeWatch(self.rdzv) if a.rank == 0 else None
            start = self._restore(a, model, engine)
            outcome = self._train(a, model, engine, start, watch)
            ok = True
            return outcome
        except Exception as e:
            if self.exit_on_failure and is_peer_failure(e):
                os._exit(RESTART_EXIT_CODE)  # closes every socket now; the agent starts a fresh process
            raise
        finally:
            if watch is not None:
                watch.close()
            if ok:
                assert engine is not None and groups is not None
                engine.close()
                if emulator is not None:
                    emulator.close()
                    dist.barrier()
                    if a.rank == 0:
                        cleanup(emulator.key)
                groups.destroy()
            else:  # a peer is gone: close sockets first so nothing blocks on it, then drop the rest
                Rendezvous.teardown()
                if engine is not None:
                    with contextlib.suppress(Exception):  # its collectives failed with the peer
                        engine.close()
                if emulator is not None:
                    emulator.close()
                    cleanup(emulator.key)

    def _run_model_parallel(self, a: Assignment) -> EpochOutcome:
        """Tensor/pipeline-parallel jobs train in one epoch: their in-memory state is not pooled across a
        re-formation yet, so after a loss they stop with a reason instead of resuming wrongly."""
        if a.epoch > 1 or a.resume_step > 0:
            raise ModelParallelNotElastic(
                f"a job with tensor/pipeline parallelism (tp={self.cfg.parallel.tp}, pp={self.cfg.parallel.pp}) "
                "cannot resume after losing a worker yet; resubmit it (set checkpoint.interval_steps to keep "
                "progress) or run it with tp=1, pp=1 to make it elastic"
            )
        result = train(replace(self.cfg, datacenters=a.datacenters), sink=self.sink, device=self.device,
                       keep_params=self.keep_params)
        return EpochOutcome(finished=True, result=result)

    def _restore(self, a: Assignment, model: torch.nn.Module, engine: GradientSync) -> int:
        """Load the state this epoch starts from; returns the step to train next. Afterwards this rank holds
        its own shard of that step, so a failure before the next step still resumes from memory."""
        start = self._load_state(a, model, engine)
        self.snapshots.discard_after(start)
        self.snapshots.append(engine.local_shard(start))
        return start

    def _load_state(self, a: Assignment, model: torch.nn.Module, engine: GradientSync) -> int:
        shapes = {n: p.shape for n, p in model.named_parameters()}
        if a.epoch > 1 and not a.from_checkpoint:
            mine = self.snapshots.get(a.resume_step)
            offers: list[LocalShard | None] = [None] * dist.get_world_size()
            dist.all_gather_object(offers, mine)  # every rank pools the same shards → same decision
            try:
                params, optimizer = assemble([o for o in offers if o is not None], shapes)
            except IncompleteState as e:
                if a.rank == 0:
                    self.on_event("state_incomplete", f"{e}; resuming from the durable checkpoint", {})
            else:
                self._load(model, engine, params, optimizer)
                return a.resume_step
        ck = ckpt_io.load_latest(self.cfg.checkpoint_dir) if self.cfg.checkpoint_dir else None
        if ck is None:
            if a.epoch > 1 and a.rank == 0:
                self.on_event("restarted", "no copy of the state survived and there is no checkpoint: "
                              "training restarts from step 0", {})  # fmt: skip
            return 0
        ckpt_io.check_fingerprint(ck, fingerprint(self.cfg), self.cfg.checkpoint_dir)
        self._load(model, engine, ck.model, ck.optimizer)
        if a.rank == 0:
            self.on_event("checkpoint_loaded", f"resumed from the durable checkpoint of step {ck.step}",
                          {"step": ck.step})  # fmt: skip
        return ck.step

    @staticmethod
    def _load(model: torch.nn.Module, engine: GradientSync, params: dict[str, torch.Tensor], optimizer: dict) -> None:
        engine.synchronize()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name].reshape(p.shape))
        engine.load_optimizer_state(optimizer)

    def _train(
        self, a: Assignment, model: torch.nn.Module, engine: GradientSync, start: int, watch: PendingChangeWatch | None
    ) -> EpochOutcome:
        cfg, device, rank, world = self.cfg, self.device, a.rank, a.world_size
        data = TextDataset(cfg.data, cfg.model.seq_len, cfg.seed)
        pending: tuple | None = None
        first_loss = final_loss = float("nan")
        timed_tokens, timed_s, inter_dc_total, steps_here = 0, 0.0, 0, 0
        leave = False

        # Per-rank heartbeats go out of band, so the service can name a rank that stopped finishing steps.
        rank_step = getattr(self.sink, "rank_step", None)
        peak = measure_peak_flops(device) if rank == 0 and self.epochs == 1 else self._peak
        self._peak = peak

        def publish(stats: torch.Tensor, work: dist.Work, step_s: float, st, step: int, done_at: float,
                    data_s: float) -> float:
            nonlocal leave
            work.wait()
            loss, inter_dc = stats[0].item(), int(stats[1].item())
            leave = leave or stats[2].item() > 0  # every rank reads the same sum: all leave after one step
            if rank == 0:
                record = progress_record(cfg, step, loss, step_s, st, inter_dc, done_at, data_s=data_s,
                                         peak=peak, world=world)
                record.update(epoch=a.epoch, workers=world)
                self.sink.step(record)
            return loss

        step = start
        while step < cfg.steps:
            loss_sum, stats, step_s, data_s = timed_step(engine, data, cfg, step, rank, world, device, rank_step,
                                                         snapshot=True)  # fmt: skip
            assert stats.shard is not None
            self.snapshots.append(stats.shard)
            flag = 1.0 if watch is not None and watch.flag.is_set() else 0.0
            stats_tensor = torch.stack(
                [loss_sum.float().cpu(), torch.tensor(float(stats.inter_dc_bytes)), torch.tensor(flag)]
            )
            work = dist.all_reduce(stats_tensor, async_op=True)
            if pending is not None:
                loss = publish(*pending)
                first_loss = loss if math.isnan(first_loss) else first_loss
            pending = (stats_tensor, work, step_s, stats, step, time.time(), data_s)
            if steps_here > 0:
                timed_tokens += cfg.tokens_per_step
                timed_s += step_s
            steps_here += 1
            inter_dc_total += stats.inter_dc_bytes
            step += 1
            self._maybe_checkpoint(a, engine, model, step)
            if leave and step < cfg.steps:
                publish(*pending)
                return EpochOutcome(finished=False)  # a newcomer joins at this step boundary

        if pending is not None:
            final_loss = publish(*pending)
        if math.isnan(first_loss):
            first_loss = final_loss
        held_out = TextDataset(cfg.data, cfg.model.seq_len, cfg.seed, split="eval")
        engine.synchronize()
        eval_loss = evaluate(engine.model, held_out, cfg, device)
        self.final_params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        if cfg.checkpoint_dir and (cfg.checkpoint_every == 0 or cfg.steps % cfg.checkpoint_every):
            self._checkpoint(a, engine, model, cfg.steps)  # the final state, always
        totals = torch.tensor([float(inter_dc_total), float(steps_here)])
        dist.all_reduce(totals)
        result = TrainResult(
            first_loss=first_loss, final_loss=final_loss, eval_loss=eval_loss, steps=cfg.steps,
            tokens_per_s=timed_tokens / timed_s if timed_s else 0.0,
            inter_dc_bytes_per_step=totals[0].item() / max(1, steps_here),
            optimizer_state_bytes=engine.optimizer_state_nbytes(),
            final_params=self.final_params if self.keep_params else None,
        )  # fmt: skip
        return EpochOutcome(finished=True, result=result)

    # -- durable checkpoints ---------------------------------------------------------------------------------
    def _maybe_checkpoint(self, a: Assignment, engine: GradientSync, model: torch.nn.Module, step: int) -> None:
        every = self.cfg.checkpoint_every
        if self.cfg.checkpoint_dir and every and step % every == 0:
            self._checkpoint(a, engine, model, step)

    def _checkpoint(self, a: Assignment, engine: GradientSync, model: torch.nn.Module, step: int) -> None:
        """Gather the full state (inside each DC) and let rank 0 write it on a background thread."""
        optimizer = engine.optimizer_state()
        if a.rank != 0:
            return
        engine.synchronize()
        state = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
        ck = ckpt_io.Checkpoint(step=step, model=state, optimizer=optimizer, fingerprint=fingerprint(self.cfg))
        self._wait_writer()  # one write at a time, in step order
        self._writer = threading.Thread(
            target=ckpt_io.save, args=(self.cfg.checkpoint_dir, ck), name="meridian-checkpoint", daemon=True
        )
        self._writer.start()

    def _wait_writer(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
