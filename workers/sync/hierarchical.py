"""The inter-datacenter sync engine: bucketed HAR, optionally overlapped, with a replicated or sharded AdamW.

Per step, on every rank (``last`` = the last micro-batch; earlier ones only accumulate, no communication)::

    backward(loss, last_micro_batch=last)
        last: each bucket, once complete, is started on the comm thread (overlap) — or in step():
            # 1) reduce-scatter inside the DC
            # 2) all-reduce the shard across DCs, in chunks, all in flight (InterDCComm: compression,
            #    bytes, WAN emulation); buckets stay in flight together
    step(lr)
        wait for what is still outstanding, bucket by bucket:
            # 3) all-gather inside the DC                 (replicated optimizer only)
        replicated: clip_grad_norm_ + AdamW on every parameter
        sharded:    clip + AdamW on this rank's shard, then all-gather updated parameters in the DC;
                    with overlap each module's forward pre-hook waits for its own buckets, so the gather
                    overlaps the next forward; without, step() waits for it.

With ``delay_one_step`` the sync runs one step behind (an exact sync whose result is applied a step late)::

    backward(loss, last_micro_batch=last)
        last, on CPU: each bucket, once complete, is reduce-scattered (step 1) into a spare set, step 2 started there
    step(lr) at step t
        (without overlap: the same now; on CUDA: copy every bucket into the spare set and start steps 1-2 there)
        wait for step t-1's sync (started a whole step ago, so normally done), 3) all-gather (replicated)
        copy its result into the buckets (sharded: this rank's shard only); clip + AdamW as above, on step t-1's
        averaged gradients

The link has the whole next step (forward, backward) to finish, instead of what is left of backward. Two spare
sets alternate, so step t's sync never writes where step t-1's result is read. Step 0 applies nothing; a
snapshot or re-formation drops the sync in flight.

With ``local_lookahead`` as well (sharded optimizer only), step t+1 does not compute at stale parameters::

    step(lr) at step t
        step t's sync started as above, this rank's shard of the DC-summed gradients kept (after step 1)
        commit: wait for step t-1's sync; AdamW on the fp32 committed shard with it (step t-1's lr)
        look ahead: parameters <- AdamW(committed, DC-summed gradients × world / DC size), moments untouched
        all-gather the parameters in the DC; step t+1's forward runs at them
    synchronize()
        wait for the sync in flight, commit it, parameters <- committed: nothing is dropped

The first ``lookahead_after`` steps (by default the learning-rate warm-up's, at least 20) sync exactly, as
without ``delay_one_step``: while AdamW's moments are young a look-ahead strays furthest. The engine counts
them by the committed updates, so a resumed job carries on in the same phase. With ``lookahead_when_exposed``
(armed) the look-ahead takes over only if the exact steps before it waited for the sync and a trial of it
stepped faster (:mod:`meridian.workers.sync.lookahead_decision`), otherwise the job stays exact; an armed engine
measures again after a resume.

So every DC commits the exact global-batch update of every step, in order; step t+1's gradients are
evaluated where this DC's own update of step t led, a local-versus-global difference away from the exact
point, instead of a whole step behind (``delay_one_step`` alone).

Every rank issues its inter-DC collectives in global segment order, bucket by bucket, so any datacenter
sizes work without deadlock. Never builds process groups: it gets them from :class:`DCGroups`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn

from meridian.workers.contracts.config import Compression, OptimConfig, SyncConfig, lookahead_start
from meridian.workers.distributed.layout import DCGroups
from meridian.workers.distributed.mp_norm import clip_grad_norm
from meridian.workers.optim.adamw import build_adamw, full_state_of, load_full_state, set_lr, state_nbytes
from meridian.workers.state.replica_state import (
    FeedbackShard,
    LocalShard,
    feedback_of_full_state,
    replicated_shard,
)
from meridian.workers.sync.engine import GradientSync, StepStats, broadcast_parameters
from meridian.workers.sync.feedback_state import feedback_shard, load_feedback
from meridian.workers.sync.grad_buffer import Bucket, GradBuffer
from meridian.workers.sync.har import (
    all_gather_in_dc,
    reduce_scatter_in_dc,
    shard_view,
    start_all_reduce_across_dcs,
)
from meridian.workers.sync.inter_dc import InterDCComm
from meridian.workers.sync.lookahead_decision import LookaheadChooser, LookaheadDecision
from meridian.workers.sync.overlap import BucketPipeline, InFlight, finish_all
from meridian.workers.sync.sharded_adamw import ShardedAdamW
from meridian.workers.wan.emulator import WanEmulator


class HierarchicalSync(GradientSync):
    """Bucketed HAR of gradients, then AdamW: replicated, or sharded inside each DC (``shard_optimizer``)."""

    def __init__(
        self,
        model: nn.Module,
        groups: DCGroups,
        sync: SyncConfig,
        optim: OptimConfig,
        *,
        emulator: WanEmulator | None = None,
        broadcast_params: bool = True,
        grad_scale: float = 1.0,
    ) -> None:
        self.model = model
        self.groups = groups
        self.optim_cfg = optim
        # Alone in its DC with no inter-DC step (DiLoCo's inner sync with one rank per DC), this rank's gradients
        # are already the sum: nothing to start per bucket (~25 µs each on CPU) and no comm thread to hand off to.
        self.alone = groups.dc_size == 1 and not groups.inter_dc
        self.overlap = sync.overlap and not self.alone
        # Inside one data-parallel group only: with tensor/pipeline parallelism other ranks hold other parts.
        if broadcast_params:
            broadcast_parameters(model, src=groups.world_ranks[0], group=groups.world)
        self.buffer = GradBuffer(model, bucket_mb=sync.bucket_mb, pad_to=groups.layout.units)
        self.comm = InterDCComm(sync.compression, emulator=emulator)  # the only inter-DC traffic
        self.chunk_bytes = sync.inter_dc_chunk_mb * 2**20
        self.sharded: ShardedAdamW | None = None
        self.optimizer: torch.optim.AdamW | None = None
        self.lookahead = sync.local_lookahead
        if self.lookahead and groups.mp_norm is not None:
            raise ValueError("sync.local_lookahead applies to data parallelism only (tp = pp = 1)")
        if sync.shard_optimizer:
            self.sharded = ShardedAdamW(model, self.buffer, groups, optim, keep_committed=self.lookahead)
            if self.overlap:
                self.sharded.install_prefetch_hooks(model)
        else:
            self.optimizer = build_adamw(model, optim)
        self.delayed = sync.delay_one_step
        self.grad_scale = grad_scale
        """Factor on the synced gradients before clipping and AdamW (DiLoCo's inner sync: DC sum → global-batch
        scale). Applied here, once, rather than to the loss: a pipeline stage's loss already carries the scale
        in the gradient the next stage sent back, so scaling every stage's loss compounds it."""
        if grad_scale != 1.0 and self.delayed:
            raise ValueError("grad_scale applies to an exact (not delay_one_step) sync only")
        self.exact_first = lookahead_start(sync.lookahead_after, optim.warmup_steps) if self.lookahead else 0
        """Look-ahead: the steps synced exactly before it takes over."""
        self.chooser = (LookaheadChooser(sync.lookahead_when_exposed, self.exact_first)
                        if self.lookahead and sync.lookahead_when_exposed is not None else None)
        """Look-ahead armed, not set: tried only if the exact steps waited for the sync, kept only if faster."""
        # Delayed, the sync of step t hides behind step t+1 whole. On CPU each bucket is still copied aside and
        # started (HAR step 1 included) by the comm thread during backward; on CUDA it starts in step(), so no
        # copy on the communication stream races the next step's use of the gradients.
        self.late_overlap = self.overlap and self.delayed and self.buffer.buckets[0].grad.device.type == "cpu"
        self.pipeline = BucketPipeline(
            self.buffer, self._start_bucket,
            overlap=self.overlap and (not self.delayed or self.exact_first > 0 or self.chooser is not None
                                      or self.late_overlap),
        )
        self._intra_dc_s = 0.0  # HAR step 1 time this step, for the per-tier metrics
        self._spares: list[list[torch.Tensor]] = []
        """Delayed: ``[where this step's sync goes, where the last step's runs]``; swapped every step."""
        if self.delayed and self.chooser is None:  # armed: made only if the look-ahead is chosen
            self._make_spares()
        self._in_flight: list[InFlight] = []
        """Delayed: the sync started by the last ``step()`` (none before the first)."""
        self._in_flight_lr = 0.0
        """Look-ahead: the learning rate of the step whose sync is in flight (its commit uses it)."""
        self._local: list[torch.Tensor] = []
        """Look-ahead: this rank's shard of each bucket's DC-summed gradients of the last step."""
        self._scale = len(groups.world_ranks) / groups.dc_size
        """Look-ahead: DC sum → estimate of the global-batch sum (samples are split evenly over ranks)."""

    def _make_spares(self) -> None:
        self._spares = [[torch.zeros_like(b.grad) for b in self.buffer.buckets] for _ in range(2)]

    @property
    def late(self) -> bool:
        """Whether this step's sync is applied one step late (``delay_one_step``, after the exact first steps;
        armed, during the trial and once the look-ahead was kept)."""
        if not self.delayed:
            return False
        if self.sharded is None:
            return True
        if self.chooser is not None:
            return self.chooser.lookahead
        return self.sharded.steps >= self.exact_first

    def _start_bucket(self, bucket: Bucket) -> InFlight:
        if self.late:  # one step late: sync in a spare set, the next backward accumulates into the bucket meanwhile
            spare = self._spares[0][bucket.index]
            if self.pipeline.streams is None:
                # On CPU step 1 runs here, to its end: it reads the bucket and writes its shard straight into the
                # spare set, which is all steps 2-3 touch. (On CUDA the copy is queued on the communication stream
                # as before.)
                return self._start_sync(bucket.grad, bucket.index, into=spare, keep_local=self.lookahead)
            spare.copy_(bucket.grad)
            return self._start_sync(spare, bucket.index, keep_local=self.lookahead)
        return self._start_sync(bucket.grad, bucket.index)

    def _start_sync(
        self, g: torch.Tensor, index: int, *, into: torch.Tensor | None = None, keep_local: bool = False
    ) -> InFlight:
        """HAR steps 1-2 of bucket ``index``'s gradients ``g`` (in ``into`` when given, ``g`` left as it was),
        started; step 3 (replicated optimizer) runs when it is finished."""
        t0 = time.perf_counter()
        shard = reduce_scatter_in_dc(g, self.groups, into=into)  # 1) reduce-scatter inside the DC
        self._intra_dc_s += time.perf_counter() - t0
        synced = g if into is None else into  # the buffer whose shard holds the DC's sum from here on
        if keep_local:  # step 2 sums in place: keep this DC's own sum for the look-ahead
            if len(self._local) <= index:
                self._local.append(shard.clone())
            else:
                self._local[index].copy_(shard)
        # 2) all-reduce the shard across DCs: chunked, every chunk in flight, through InterDCComm
        handles = start_all_reduce_across_dcs(
            synced, self.groups, self.comm, chunk_bytes=self.chunk_bytes, bucket=index
        )
        if self.sharded is not None:  # 3) is the all-gather of updated parameters, after AdamW
            return InFlight(list(handles))
        return InFlight(
            list(handles), then=lambda: all_gather_in_dc(synced, self.groups)
        )  # 3) all-gather in the DC

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        for flight in self._in_flight:  # delayed: note when the previous step's sync completes
            flight.poll()
        if not last_micro_batch or (self.late and not self.late_overlap):  # the sync starts in step()
            loss.backward()
            return
        self.pipeline.arm()
        try:
            loss.backward()
        finally:
            self.pipeline.backward_done()
        for flight in self._in_flight:
            flight.poll()

    def step(self, lr: float, *, snapshot_as: int | None = None) -> StepStats:
        commit_lr = lr
        late = self.late
        deciding = self.chooser is not None and self.chooser.decision is None
        if deciding:
            assert self.chooser is not None and self.sharded is not None
            self.chooser.due_at(self.sharded.steps)  # fixed at the first step, after any restore
        if late:
            commit_lr = self._in_flight_lr if self.lookahead else lr
            self._in_flight_lr = lr
            comm_s, exposed_s, ready = self._swap_in_previous()
        elif self.alone:
            comm_s, exposed_s, ready = 0.0, 0.0, True
        else:
            comm_s, exposed_s = self.pipeline.finish()
            ready = True
        intra_dc_s, self._intra_dc_s = self._intra_dc_s, 0.0  # every bucket has finished
        if self.grad_scale != 1.0:
            self._scale_synced()
        shard = None
        if not ready:  # delayed, first step: no averaged gradients yet, nothing to apply
            norm = torch.zeros((), device=self.buffer.buckets[0].grad.device)
            waited = 0.0
            if snapshot_as is not None:
                shard = self.local_shard(snapshot_as)
            if self.lookahead:
                assert self.sharded is not None
                self.sharded.lookahead(lr, self._local, self._scale)
                self.sharded.gather_params(async_op=self.overlap)
                waited = self.sharded.take_wait_s()
        elif self.sharded is not None:
            norm = self.sharded.step(commit_lr, write_params=not (self.lookahead and late)).detach()
            if snapshot_as is not None:  # before the all-gather: this rank's shard is already final
                shard = self.sharded.local_shard(snapshot_as)
            if self.lookahead and late:
                self.sharded.lookahead(lr, self._local, self._scale)
            self.sharded.gather_params(async_op=self.overlap)
            waited = self.sharded.take_wait_s()  # norm all-reduce, gathers, and last step's forward waits
        else:
            assert self.optimizer is not None
            norm = clip_grad_norm(self._named(), self.optim_cfg.grad_clip, self.groups.mp_norm).detach()
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            waited = 0.0
            if snapshot_as is not None:
                shard = replicated_shard(self.optimizer, self._named(), snapshot_as)
        self.buffer.zero()
        decision = self._decide(exposed_s) if deciding else None
        if decision is not None and not decision.lookahead and late and snapshot_as is not None:
            shard = self.local_shard(snapshot_as)  # the lost trial just committed its sync in flight: include it
        return StepStats(
            grad_norm=norm,
            inter_dc_bytes=self.comm.take_bytes(),
            sync_wait_s=exposed_s + waited,
            comm_s=comm_s,
            exposed_s=exposed_s,
            intra_dc_comm_s=intra_dc_s,
            shard=shard,
            late=late,
            lookahead_decision=decision,
        )

    def _decide(self, exposed_s: float) -> LookaheadDecision | None:
        """Armed look-ahead, after each step until decided: the chooser keeps the step's figures and, at its
        checks, every rank decides the same (one small all-reduce each). A trial of the look-ahead gets its spare
        gradient sets; a trial that lost commits the sync in flight, and the next step is exact again."""
        assert self.chooser is not None and self.sharded is not None
        decision = self.chooser.after_step(self.sharded.steps, exposed_s, self.groups.world,
                                           self.buffer.buckets[0].grad.device)
        if self.chooser.trying and not self._spares:
            self._make_spares()
        if decision is not None and not decision.lookahead and self._in_flight:
            self._commit_in_flight()
            self._spares, self._local = [], []
        return decision

    def _scale_synced(self) -> None:
        """Multiply the synced gradients by ``grad_scale``: the shard the sharded optimizer reads, or every
        element for the replicated one (whose clipping norm and AdamW read the parameters' ``.grad`` views)."""
        for bucket in self.buffer.buckets:
            grad = bucket.grad if self.sharded is None else shard_view(bucket.grad, self.groups)
            grad.mul_(self.grad_scale)

    def _swap_in_previous(self) -> tuple[float, float, bool]:
        """Delayed: start this step's sync on a spare set, then put the previous step's synced gradients in
        the buckets. Returns (comm_s, exposed_s) of the previous sync, and whether there was one."""
        previous_set = self._spares[1]
        started = self.pipeline.take_started()  # each bucket's step 1 into self._spares[0], step 2 started there
        streams = self.pipeline.streams
        if streams is not None:
            # CUDA: those copies were queued on the communication stream; the training stream writes the buckets
            # next (the previous step's synced gradients, then zeros), so it waits for them to have been read.
            streams.training.wait_stream(streams.stream)
        previous, self._in_flight = self._in_flight, started
        self._spares.reverse()  # next step writes where this step reads, once read
        if not previous:
            return 0.0, 0.0, False
        t0 = time.perf_counter()
        comm_s = finish_all(previous)
        exposed_s = time.perf_counter() - t0
        self._take_synced(previous_set)
        return comm_s, exposed_s, True

    def _take_synced(self, synced_set: list[torch.Tensor]) -> None:
        """Put a spare set's synced gradients in the buckets: the sharded optimizer reads only this rank's
        shard of them (the rest of a spare set is never synced), the replicated one every element."""
        for bucket, synced in zip(self.buffer.buckets, synced_set, strict=True):
            if self.sharded is not None:
                shard_view(bucket.grad, self.groups).copy_(shard_view(synced, self.groups))
            else:
                bucket.grad.copy_(synced)

    def _drop_in_flight(self) -> None:
        """Delayed: finish the sync still in flight and forget it (a snapshot does not carry it)."""
        for flight in self._in_flight:
            flight.finish()
        self._in_flight = []

    def local_shard(self, step: int) -> LocalShard:
        if self.sharded is not None:
            self.sharded.wait_params()
            return self._with_feedback(self.sharded.local_shard(step))
        assert self.optimizer is not None
        return self._with_feedback(replicated_shard(self.optimizer, self._named(), step))

    # Compressed sync: the error-feedback residuals go with the state (:mod:`meridian.workers.sync.feedback_state`).

    @property
    def feedback_held(self) -> bool:
        return self.comm.compression is not Compression.NONE and bool(self.groups.inter_dc)

    def _with_feedback(self, shard: LocalShard) -> LocalShard:
        """``shard`` with this rank's residuals, unless a delayed sync is in flight: it is changing them, and the
        gradient it carries is not kept either (a resume then restarts the residuals at zero)."""
        if self._in_flight:
            return shard
        grads = [b.grad for b in self.buffer.buckets]
        held = feedback_shard(self.comm, self.buffer.buckets, grads, self.groups, self.chunk_bytes)
        return dataclasses.replace(shard, feedback=held) if held else shard

    def _load_feedback(self, held: tuple[FeedbackShard, ...]) -> None:
        grads = [b.grad for b in self.buffer.buckets]
        load_feedback(self.comm, self.buffer.buckets, grads, self.groups, self.chunk_bytes, held)

    def synchronize(self) -> None:
        if self.chooser is not None:
            self.chooser.skip_next()  # a validation pass or the job's end is not a step's time
        if self.lookahead and self._in_flight:
            self._commit_in_flight()
        if self.sharded is not None:
            self.sharded.wait_params()

    def _commit_in_flight(self) -> None:
        """Look-ahead: land the sync in flight and commit it; the parameters become the committed ones (what
        one process would hold after every step so far), gathered in the DC."""
        assert self.sharded is not None
        finish_all(self._in_flight)
        self._in_flight = []
        self._take_synced(self._spares[1])
        self.sharded.step(self._in_flight_lr)
        self.sharded.gather_params(async_op=False)
        self.sharded.take_wait_s()
        self.buffer.zero()

    def optimizer_state(self) -> dict[str, Any]:
        if self.sharded is not None:
            return self.sharded.full_state()
        assert self.optimizer is not None
        return full_state_of(self.optimizer, self._named())

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self._load_feedback(feedback_of_full_state(state))
        if self.sharded is not None:
            self.sharded.load_full_state(state)
            return
        assert self.optimizer is not None
        load_full_state(self.optimizer, self._named(), state)

    def owned_ranges(self) -> list[tuple[str, int, int]] | None:
        return self.sharded.owned_ranges() if self.sharded is not None else None

    def load_local_shard(self, shard: LocalShard) -> None:
        if self.sharded is None:
            super().load_local_shard(shard)
        else:
            self.sharded.load_local_shard(shard)
            self._load_feedback(shard.feedback)

    def optimizer_state_nbytes(self) -> int:
        if self.sharded is not None:
            return self.sharded.state_nbytes()
        return state_nbytes(self.optimizer)

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        return [(s.name, s.param) for s in self.buffer.slots]

    def close(self) -> None:
        self._drop_in_flight()  # no collective may outlive the engine's process groups
        self.pipeline.close()
        if self.sharded is not None:
            self.sharded.wait_params()
            self.sharded.remove_hooks()
