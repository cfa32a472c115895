"""The training loop of a job that survives losing nodes: join an epoch, train, and on a peer's failure
re-form over the survivors and resume from memory.

One *epoch* is one membership: its ranks, its process groups, its sync engine. Every rank runs::

    join → form the process group → the training loop's epoch (:mod:`meridian.workers.loop.train`): build
           model, engine, WAN emulator for this epoch's layout
         → restore: rebuild the state from the survivors' in-memory shards of the step they all completed,
                    each rank receiving only what it lacks (:mod:`meridian.workers.elastic.state_exchange`), or
                    the durable checkpoint if they cannot cover the whole state, or nothing on a first start
         → train, snapshotting this rank's shard every ``snapshot_every`` steps (before the parameter
           all-gather; with k > 1 a failure resumes from the last snapshot and trains up to k - 1 steps again)
    a collective fails  → tear down every group (so blocked peers fail fast too) → join again: on CPU in the same
                          process, its TCP connections shut down first; on a GPU in the agent's next process
    a newcomer waits    → every rank leaves after the same step (the flag rides on the stats all-reduce)
                          → join again; the newcomer receives the state from the pooled shards

The data order depends only on the step and the global batch (:meth:`TextDataset.step_batches`), so a
resized epoch trains on exactly the samples the old one would have: none skipped, none seen twice.
No Ray here: the coordinator is reached through :class:`meridian.workers.elastic.rendezvous.Rendezvous`.
The loop itself is the one plain training runs; what is elastic — restore, snapshot, checkpoint, leave at a
step boundary — is this module's :class:`ElasticState`, which the loop calls at fixed points.
"""

from __future__ import annotations

import enum
import gc
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.fingerprint import fingerprint
from meridian.workers.contracts.rendezvous import Assignment
from meridian.workers.elastic.durable import Checkpointer, restore_from, restore_latest
from meridian.workers.elastic.failures import FailureJudge, FailureKind, OwnFailure, is_peer_failure
from meridian.workers.elastic.protocol import KEEP_SNAPSHOTS, RESTART_EXIT_CODE
from meridian.workers.elastic.rendezvous import JobFinished, Rendezvous
from meridian.workers.elastic.sockets import shut_down_tcp_sockets
from meridian.workers.elastic.state_exchange import rebuild_state
from meridian.workers.loop.prepared import freeze_long_lived
from meridian.workers.loop.replica import Membership, Replica
from meridian.workers.loop.train import EpochOutcome, ProgressSink, TrainingLoop, TrainResult
from meridian.workers.state.replica_state import IncompleteState, LocalShard
from meridian.workers.state.snapshots import SnapshotStore

__all__ = ["ElasticTrainer", "fingerprint", "is_peer_failure"]  # fingerprint, is_peer_failure: re-exported

EventFn = Callable[[str, str, dict[str, Any]], None]


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


class Suspended(Exception):  # noqa: N818 - not an error: the epoch's way out when the job is suspended
    """This rank wrote its part of the checkpoint of ``step`` for a suspended job: it leaves the job."""

    def __init__(self, step: int) -> None:
        super().__init__(f"suspended after writing the checkpoint of step {step}")
        self.step = step


class OnPeerFailure(enum.Enum):
    """What a rank does when a peer's failure ends its epoch."""

    REJOIN = "rejoin"
    """Tear the epoch down and join the next one in this process, its sockets left to that teardown. The default:
    tests and benchmarks that drive a trainer without an agent."""
    SHUT_SOCKETS_AND_REJOIN = "shut-sockets-and-rejoin"
    """Shut this process's TCP connections down first (what a process exit would do for it), so peers blocked on
    it and its own communication thread fail at once; then rejoin in this process. The agent's training process
    on CPU."""
    EXIT = "exit"
    """Leave the process (:mod:`meridian.workers.elastic.agent` starts a new one): on a GPU, where shutting
    sockets down under NCCL is not checked, or with ``MERIDIAN_REFORM=new-process``."""


class ElasticTrainer:
    """One rank of an elastic job; :meth:`run` returns when the job's last step is done."""

    def __init__(
        self, cfg: TrainConfig, rendezvous: Rendezvous, *, sink: ProgressSink, on_event: EventFn,
        device: torch.device | None = None, join_timeout_s: float = 600.0, snapshots: SnapshotStore | None = None,
        on_peer_failure: OnPeerFailure = OnPeerFailure.REJOIN, on_epoch: Callable[[int], None] | None = None,
        keep_params: bool = False,
        peak: Any = None, on_peak: Callable[[Any], None] | None = None, before_exit: Callable[[], None] | None = None,
        snapshot_every: int = 1, on_snapshot_cadence: Callable[[int], None] | None = None,
        on_recovery: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.rdzv = rendezvous
        self.sink = sink
        self.on_event = on_event
        self.join_timeout_s = join_timeout_s
        self.snapshots = snapshots or SnapshotStore(KEEP_SNAPSHOTS)
        self.on_peer_failure = on_peer_failure
        self._garbage = False
        """An epoch of this process ended: :meth:`collect_last_epoch` has its cycles to free."""
        self.failures = FailureJudge()
        """Tells a lost peer from this job's own error, by type (:mod:`meridian.workers.elastic.failures`)."""
        self._assignment: Assignment | None = None
        self.on_recovery = on_recovery or (lambda: None)
        """Called when this process joins again after a peer's failure (its agent counts the job's recoveries)."""
        self.before_exit = before_exit or (lambda: None)
        """Called right before that exit: the agent hands over to the next process without waiting for it."""
        self.on_epoch = on_epoch or (lambda n: None)
        self.snapshot_every = snapshot_every
        """The widest snapshot cadence this worker's epochs agreed (an earlier training process's included, from
        its agent): sent with every join, so the next epoch starts there."""
        self.on_snapshot_cadence = on_snapshot_cadence or (lambda every: None)
        self.loop = TrainingLoop(cfg, sink=sink, device=device, keep_params=keep_params, on_failure=self._on_failure,
                                 peak=peak, on_peak=on_peak)
        self.checkpoints = Checkpointer(cfg.checkpoint_dir, fingerprint(cfg))

    def run(self) -> TrainResult | None:
        """Train to the last step; ``None`` when the job finished without this worker (it joined too late) or was
        suspended (this rank wrote its part of the checkpoint it resumes from)."""
        while True:
            last = self.snapshots.last_step
            self.snapshots.read_ahead(last)  # while the join waits for the others: the step it most likely resumes
            try:
                a = self.rdzv.join(last_step=last, timeout_s=self.join_timeout_s, snapshot_every=self.snapshot_every)
            except JobFinished:
                return None
            if (pace := getattr(self.sink, "pace", None)) is not None:
                pace(a.world_size)  # a large epoch's ranks batch their heartbeats for longer
            self.on_epoch(a.epoch)
            try:
                outcome = self._run_epoch(a)
                self.checkpoints.wait()  # a save in flight needs this epoch's groups, torn down next
            except Suspended as s:
                Rendezvous.teardown()
                self.rdzv.suspended(s.step)
                return None  # the job goes on later, from the checkpoint, in other processes
            except Exception as e:
                kind = self._judge(e)
                self.failures.handled()
                if kind is FailureKind.OWN:
                    raise
                if kind is FailureKind.REPEATED:
                    raise OwnFailure(f"{type(e).__name__}: {e} — it ended epoch {a.epoch} at step {self.snapshots.last_step} "
                                     "again after a re-formation that changed nothing (no peer left or joined): this "
                                     "job's own error, not a lost peer's") from e
                Rendezvous.teardown()
                self._garbage = True
                self.on_recovery()
                continue
            Rendezvous.teardown()
            self._garbage = True
            if outcome.finished:
                assert outcome.result is not None
                if a.rank == 0 and outcome.result.eval_skipped:
                    self.on_event("final_eval_skipped", outcome.result.eval_skipped, {})
                self.checkpoints.wait()
                self.rdzv.finish()
                return outcome.result

    def collect_last_epoch(self) -> None:
        """Free what the last epoch of this process left in reference cycles, once the next epoch's first step is
        done (called by :meth:`ElasticState.step_done`).

        Its groups, engine and optimizer are held in cycles (a failed collective's exception, its traceback's
        frames, the executor's futures), so they outlive the epoch until Python's cyclic collector runs: measured
        in ``tests/test_elastic_loop.py``, the epochs after the first kept 9-19 gloo threads more, their sockets
        and the old replicas' memory. A full collection of a training process walks ~295k objects (0.2-0.6 s on
        two busy cores), so the first epoch freezes what lives before it (:func:`gc.freeze`: torch, the training
        stack) and this walks only what came after (22-42k objects, 30-80 ms in that test with four ranks on two
        cores, the groups' own teardown included). After the first step, not before the join: that step is what
        a recovery waits for."""
        if self._garbage:
            self._garbage = False
            gc.collect()

    def _judge(self, error: BaseException) -> FailureKind:
        a = self._assignment
        membership = (a.world_size, tuple(a.datacenters)) if a is not None else ()
        return self.failures.judge(error, step=self.snapshots.last_step, membership=membership)

    def _on_failure(self, error: Exception) -> None:
        if isinstance(error, Suspended):
            return
        if self._judge(error) in (FailureKind.OWN, FailureKind.REPEATED):
            return  # the job fails with it: this process neither rejoins nor restarts
        if self.on_peer_failure is OnPeerFailure.SHUT_SOCKETS_AND_REJOIN:
            # This rank re-forms in its own process: its TCP connections go now, so peers blocked on it and its
            # own threads still inside a collective (the engine's communication thread) fail at once, and the
            # clean-up that follows joins threads that have returned (:mod:`meridian.workers.elastic.sockets`).
            shut_down_tcp_sockets()
            return
        if self.on_peer_failure is OnPeerFailure.EXIT:
            self.before_exit()  # the agent starts the next process now
            if self.loop.device.type == "cpu":
                # Peers blocked on this rank fail now, not once the exit has freed its memory. Not with NCCL: its
                # threads may abort the process on a shut socket, and on a GPU the agent waits for the exit (and
                # its code) anyway, which frees the device memory the next process needs.
                shut_down_tcp_sockets()
            os._exit(RESTART_EXIT_CODE)  # closes every socket

    # -- one epoch ----------------------------------------------------------------------------------------
    def _run_epoch(self, a: Assignment) -> EpochOutcome:
        watch = None
        self._assignment = a
        try:
            self._formed_at = time.monotonic()
            # What lives before the first epoch (torch, the training stack, the datasets) lives as long as the
            # process: the collections after a re-formation (:meth:`collect_last_epoch`) need not walk it.
            freeze_long_lived()
            self.rdzv.form(a)
            m = Membership(epoch=a.epoch, rank=a.rank, world_size=a.world_size, datacenters=a.datacenters,
                           snapshot_every=a.snapshot_every)
            watch = PendingChangeWatch(self.rdzv) if a.rank == 0 else None
            return self.loop.run_epoch(m, ElasticState(self, a, watch, self._formed_at))
        except Exception as e:
            self._on_failure(e)  # also for a failure outside the loop (forming the group, the refusal above)
            Rendezvous.teardown()  # the loop's clean-up already did, if it failed inside the loop
            raise
        finally:
            if watch is not None:
                watch.close()


class ElasticState:
    """What the loop asks of an elastic epoch: restore the state it starts from, keep each step's shard in
    memory, checkpoint, leave at a step boundary when a newcomer waits."""

    def __init__(self, trainer: ElasticTrainer, a: Assignment, watch: PendingChangeWatch | None,
                 formed_at: float = 0.0) -> None:
        self.cfg, self.a, self.watch, self.formed_at, self.trainer = trainer.cfg, a, watch, formed_at, trainer
        self.snapshots, self.checkpoints, self.on_event = trainer.snapshots, trainer.checkpoints, trainer.on_event
        self.device = trainer.loop.device
        self._loop_s: list[float] = []
        self.checkpoints.new_epoch()
        self._last: tuple[LocalShard, Any] | None = None
        """The last shard kept and its CUDA event: a checkpoint of that step writes it, copying nothing."""
        self._exchanged: dict[str, int] = {}
        """What the survivors' state exchange sent, when this epoch restored from it."""

    def restore(self, replica: Replica) -> int:
        """Load the state this epoch starts from; returns the step to train next. Afterwards this rank holds
        its own shard of that step, so a failure before the next step still resumes from memory."""
        assert replica.model is not None and replica.engine is not None
        began = time.monotonic()
        start = self._load_state(replica)
        self.snapshots.discard_after(start)
        self.keep(replica.engine.local_shard(start))
        if self.a.suspend and self.cfg.checkpoint_dir:
            # Preempted: the state every rank just restored becomes the durable checkpoint the job resumes from.
            self._checkpoint(replica, start, fresh=True)
            self.checkpoints.wait()
            raise Suspended(start)
        if self.a.rank == 0 and self.a.epoch > 1:  # where a re-formation's time goes (the bench reads it)
            self.on_event("epoch_restored", f"epoch {self.a.epoch}: process group and model ready in "
                          f"{began - self.formed_at:.1f} s, state restored in {time.monotonic() - began:.1f} s",
                          {"epoch": self.a.epoch, "setup_s": round(began - self.formed_at, 2),
                           "restore_s": round(time.monotonic() - began, 2), **self._exchanged})  # fmt: skip
        return start

    def keep(self, shard: LocalShard) -> None:
        # On a GPU the shard's copies are still in flight: written once they land, off the training thread.
        began = time.perf_counter()
        ready = self._copies_done()
        self._last = (shard, ready)
        waited_s = self.snapshots.append(shard, ready)
        # What the snapshot itself held the loop up for (a CPU's write; not the wait for the last write, which
        # only says the snapshots come too often)
        self._loop_s = [*self._loop_s[-2:], time.perf_counter() - began - waited_s]

    def snapshot_cost(self) -> tuple[float, float]:
        """(seconds a snapshot holds the loop up, seconds its background write takes): the least of the last
        three of each, so one slow write on a busy host does not widen the cadence for good."""
        return min(self._loop_s, default=0.0), min(self.snapshots.write_s, default=0.0)

    def snapshots_widened(self, every: int, loop_s: float, background_s: float, step_s: float) -> None:
        if every > self.trainer.snapshot_every:
            self.trainer.snapshot_every = every
            self.trainer.on_snapshot_cadence(every)
        if self.a.rank == 0:
            self.on_event("snapshot_cadence", f"state snapshots every {every} steps from now: one holds the loop up "
                          f"{1000 * loop_s:.1f} ms and its write takes {1000 * background_s:.0f} ms, against "
                          f"{1000 * step_s:.1f} ms steps (a failure trains up to {every - 1} steps again)",
                          {"snapshot_every": every, "loop_s": round(loop_s, 4), "write_s": round(background_s, 4),
                           "step_s": round(step_s, 4)})  # fmt: skip

    def _copies_done(self) -> Any:
        if self.device.type != "cuda":
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def leave_requested(self) -> bool:
        return self.watch is not None and self.watch.flag.is_set()

    def step_done(self, replica: Replica, steps_done: int) -> None:
        self.trainer.collect_last_epoch()
        every = self.cfg.checkpoint_every
        if self.cfg.checkpoint_dir and every and steps_done % every == 0:
            self._checkpoint(replica, steps_done)

    def finish(self, replica: Replica) -> None:
        cfg = self.cfg
        if cfg.checkpoint_dir and (cfg.checkpoint_every == 0 or cfg.steps % cfg.checkpoint_every):
            # the final state, always; read after the loop's synchronize(), not the last step's snapshot: a one-step-
            # late engine took that before it committed the last step's update (the checkpoint, and an export of it,
            # was one AdamW update behind the weights the job ended with and evaluated)
            self._checkpoint(replica, cfg.steps, fresh=True)
        self.checkpoints.wait()  # the job has finished only once its final state is written

    def _checkpoint(self, replica: Replica, step: int, *, fresh: bool = False) -> None:
        """Every rank writes its own shard of ``step``'s state, in the background; the snapshot of ``step`` kept
        in memory is reused unless ``fresh`` or the engine holds state its snapshots leave out (error feedback)."""
        assert replica.model is not None and replica.engine is not None
        if not fresh and not replica.engine.feedback_held and self._last is not None and self._last[0].step == step:
            shard, ready = self._last
        else:
            shard = replica.engine.local_shard(step)
            ready = self._copies_done()
        shapes = replica.full_shapes()
        self.checkpoints.save(shard, rank=self.a.rank, datacenter=self.a.datacenters[self.a.rank], shapes=shapes,
                              ready=ready)

    def _load_state(self, replica: Replica) -> int:
        a, model, engine = self.a, replica.model, replica.engine
        assert model is not None and engine is not None
        shapes = replica.full_shapes()  # the whole model's, on every rank: every rank plans the same exchange
        if a.epoch > 1 and not a.from_checkpoint:
            try:  # every rank pools the same offers → the same decision
                state = rebuild_state(self.snapshots.get_packed(a.resume_step), dc=a.datacenters[a.rank],
                                      needs=engine.owned_ranges(), shapes=shapes)
            except IncompleteState as e:
                if a.rank == 0:
                    self.on_event("state_incomplete", f"{e}; resuming from the durable checkpoint", {})
            else:
                state.load(model, engine)
                self._exchanged = {"state_bytes_sent": state.sent_bytes, "state_bytes_cross_dc": state.cross_dc_bytes}
                return a.resume_step
        done = (restore_latest(self.cfg.checkpoint_dir, fingerprint(self.cfg), model, engine)
                if self.cfg.checkpoint_dir else None)  # fmt: skip
        if done is None and self.cfg.resume is not None:
            return self._resume_from(replica)
        if done is None:
            if a.epoch > 1 and a.rank == 0:
                self.on_event("restarted", "no copy of the state survived and there is no checkpoint: "
                              "training restarts from step 0", {})  # fmt: skip
            return 0
        if a.rank == 0:
            self.on_event("checkpoint_loaded", f"resumed from the durable checkpoint of step {done.step}",
                          {"step": done.step, "bytes_read": done.bytes_read, "bytes_stored": done.bytes_stored})
        return done.step

    def _resume_from(self, replica: Replica) -> int:
        """A job without a checkpoint of its own starts from the one it names (``resume_from``), checked at submit
        and again here against the fingerprint admitted then; returns the step it trains first."""
        resume = self.cfg.resume
        assert resume is not None and replica.model is not None and replica.engine is not None
        done = restore_from(resume.checkpoint, json.loads(resume.fingerprint), replica.model, replica.engine,
                            optimizer=resume.loads_optimizer)
        if self.a.rank == 0:
            reset = f" ({', '.join(r.value for r in resume.reset)} reset)" if resume.reset else ""
            self.on_event("resumed_from", f"started from {resume.source}'s checkpoint of step {done.step}{reset}; "
                          f"training step {resume.start_step + 1} next",
                          {"source": resume.source, "checkpoint": resume.checkpoint, "step": done.step,
                           "start_step": resume.start_step, "reset": [r.value for r in resume.reset],
                           "bytes_read": done.bytes_read})  # fmt: skip
        return resume.start_step


