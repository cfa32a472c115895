"""DiLoCo and streaming DiLoCo: datacenters train apart for H steps and meet on the WAN only for an outer step.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105): every replica (here: every datacenter) runs H inner AdamW steps on its own data, then the
replicas average their parameter deltas ``anchor - theta`` and apply them with an outer Nesterov SGD step
to the shared *outer* parameters (the anchor), which become every replica's new start. Streaming DiLoCo
(Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", arXiv:2501.18512) syncs P
fragments of the parameters at staggered offsets (:mod:`meridian.workers.sync.diloco_schedule`), lets each
fragment's all-reduce run behind ``overlap_steps`` inner steps, and may quantise the delta (bf16 / int8 /
int4 with error feedback). When a fragment lands, the paper merges ``alpha * local + (1 - alpha) * outer`` (the
default); ``merge = "keep-progress"`` keeps what the replica trained meanwhile on top of the new outer weights
instead (:class:`~meridian.workers.contracts.config.OuterMerge`: closer to per-step sync's loss on one model,
much further on another).

Per step, on every rank::

    inner: HierarchicalSync over this DC only (reduce-scatter, sharded AdamW, all-gather; no WAN)
    after inner step t, for each fragment whose sync starts at t:
        # 1) delta of this rank's DC shard:  d = anchor - theta              (fp32, shard only)
        # 2) all-reduce d across DCs, owners of each segment (HAR step 2's groups, InterDCComm:
        #    compression, byte count, WAN emulation), kept in flight for overlap_steps inner steps
    for each fragment landing at t:
        # 3) outer Nesterov SGD on the shard:  m = mu*m + mean(d);  anchor -= lr_out * (mean(d) + mu*m)
        # 4) theta = anchor, or with overlap the paper's "mix": alpha*theta + (1-alpha)*anchor (or merge
        #    "keep-progress": theta = anchor + theta - theta_start, what trained since the sync started kept);
        #    all-gather theta in the DC

Sparse outer update (``sync.diloco.sparse_density``; SparseLoCo, Sarfi et al. 2025, arXiv:2508.15706): step 2
sends, of every chunk of the rank's shard, only the top-k of each block in 2-8 bits
(:mod:`meridian.workers.sync.sparse_codec`); what was not sent stays in the rank's error-feedback residual for the
chunk's next sync (the residuals of a sync in flight are saved as they were before it: a restore drops that sync and
measures its delta again), or with ``sparse_keep_unsent`` in the weights step 4 writes: ``anchor - residual`` in
place of ``anchor``. Each rank sparsifies its own shard; nothing is gathered to one rank.

Only step 2 crosses DCs, carrying 1/N of the fragment per rank (N = ranks in the DC), once per H/P steps.
The outer state (anchor, momentum) is sharded like the inner AdamW state, so it costs 2/N of the model per
rank; one scratch buffer the size of the model holds deltas in flight. Inner gradients are the DC's sum of
the ranks' global-batch shares times ``data-parallel ranks / dc_size``, applied once to the synced
gradients before clipping (tensor/pipeline ranks hold parts of one replica, not more samples): the DC's mean
gradient when samples are split evenly over the replicas (:func:`meridian.workers.data.text.rank_slice`
splits them within one sample). The outer average weighs every DC equally, as the paper averages its
replicas.

This module never builds process groups; it never talks across DCs except through step 2.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from meridian.workers.contracts.config import Compression, OptimConfig, OuterMerge, SyncConfig, SyncStrategy
from meridian.workers.distributed.flat_collectives import all_gather_single
from meridian.workers.distributed.layout import DCGroups, Segment
from meridian.workers.state.replica_state import (
    DILOCO_STATE_FORMAT,
    FeedbackShard,
    LocalShard,
    OuterShard,
    StatePiece,
    cut,
    feedback_of_full_state,
    replicated_shard,
)
from meridian.workers.sync.diloco_schedule import FragmentSchedule, split_fragments
from meridian.workers.sync.engine import GradientSync, StepStats
from meridian.workers.sync.feedback_state import feedback_shard, load_feedback
from meridian.workers.sync.har import (
    all_gather_in_dc,
    chunks_across_dcs,
    post_receives_across_dcs,
    shard_range,
    start_all_reduce_across_dcs,
)
from meridian.workers.sync.hierarchical import HierarchicalSync
from meridian.workers.sync.inter_dc import CommHandle, InterDCComm
from meridian.workers.sync.sparse_codec import sparse_codec_of
from meridian.workers.wan.emulator import WanEmulator


def intra_dc_view(groups: DCGroups) -> DCGroups:
    """The same groups with no inter-DC ones: HAR over this view reduces inside the DC and stops there."""
    view = copy.copy(groups)
    view.inter_dc = {}
    return view


class DiLoCoSync(GradientSync):
    """Per-step HAR inside each DC; every H steps (per fragment) an outer Nesterov step across DCs.

    Call order is :mod:`meridian.workers.sync.engine`'s. ``step`` runs the inner step, then the fragments the
    schedule names. Build every rank's engine from the same config: the schedule is what keeps the ranks'
    inter-DC collectives in the same order."""

    def __init__(
        self,
        model: nn.Module,
        groups: DCGroups,
        sync: SyncConfig,
        optim: OptimConfig,
        *,
        emulator: WanEmulator | None = None,
    ) -> None:
        if not sync.strategy.is_diloco:
            raise ValueError(
                f"DiLoCoSync needs sync.strategy 'diloco' or 'streaming-diloco', got {sync.strategy.value!r}; "
                "use build_sync to pick the engine"
            )
        cfg = sync.outer
        self.cfg, self.groups = cfg, groups
        inner_sync = dataclasses.replace(
            sync, strategy=SyncStrategy.HIERARCHICAL, compression=Compression.NONE, diloco=None
        )
        # Inner gradients: the DC's sum of its ranks' global-batch shares, times (data-parallel ranks / DC
        # ranks), once, on the synced gradients. Not the whole world (tp × pp ranks hold other parts of the
        # same replica, not more samples), and not on the loss: in a pipeline every stage but the last gets its
        # gradient from the next stage, already scaled.
        self.grad_scale = len(groups.world_ranks) / groups.dc_size
        self.inner = HierarchicalSync(model, intra_dc_view(groups), inner_sync, optim, grad_scale=self.grad_scale)
        self.model = self.inner.model
        self.buffer = self.inner.buffer
        self.buffer.flatten_params()  # the outer step writes this rank's shard of the flat parameters
        self.fragments = split_fragments([b.padded_numel for b in self.buffer.buckets], cfg.fragments)
        self.schedule = FragmentSchedule(cfg.inner_steps, cfg.fragments, cfg.overlap_steps, cfg.warmup_steps)
        self.keep_unsent = cfg.sparse_keep_unsent
        """The sparse residual lives in the weights (``sparse_keep_unsent``): the comm keeps each sync's residual
        only until it lands, and never adds it to the next delta, which already holds it."""
        self.comm = InterDCComm(sync.compression, emulator=emulator, sparse=sparse_codec_of(cfg),
                                feedback_decay=0.0 if self.keep_unsent else cfg.sparse_error_decay)  # the only inter-DC traffic
        self.chunk_bytes = sync.inter_dc_chunk_mb * 2**20
        self.bounds = [shard_range(b.data, groups) for b in self.buffer.buckets]
        # Outer state of this rank's shard, fp32 (the papers keep the outer parameters in full precision).
        self.anchor = [self._theta(b).float().clone() for b in range(len(self.buffer.buckets))]
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        self.scratch = [torch.zeros(b.padded_numel, dtype=torch.float32, device=b.data.device) for b in self.buffer.buckets]
        self.keep_progress = cfg.overlap_steps > 0 and cfg.merge is OuterMerge.KEEP_PROGRESS
        self.started = [torch.empty_like(a) for a in self.anchor] if self.keep_progress else []
        """keep-progress: this rank's shard of each bucket as it was when its fragment's sync started."""
        self.in_flight: dict[int, list[CommHandle]] = {}
        self.settled: dict[int, dict[tuple[Segment, Hashable], torch.Tensor | None]] = {}
        """Per fragment in flight: each chunk's error-feedback residual from before that sync encoded it. A restore
        drops a sync in flight and the next one measures its delta again from the same anchor, so the state to
        save (and to go back to) is this one, not the residual of a delta that was never applied."""
        self._feedback_copy: tuple[FeedbackShard, ...] | None = None
        """Host copy of the settled residuals, taken once per landing (they change only then), for the snapshots."""
        self.done = 0
        """Inner steps completed: the schedule's clock, saved with the state."""
        # Every exchange's first receive, posted now (in bucket order, the same on every owner): a fragment's
        # first sync then flows one way, as every later one does, instead of paying a round trip.
        for b, scratch in enumerate(self.scratch):
            post_receives_across_dcs(scratch, groups, self.comm, chunk_bytes=self.chunk_bytes, bucket=b)

    # -- the shard of the flat parameters this rank owns (the fp32 master where the inner AdamW keeps one)

    def _theta(self, b: int) -> torch.Tensor:
        sharded = self.inner.sharded
        if sharded is not None and b in sharded.master:
            return sharded.master[b]
        lo, hi = self.bounds[b]
        return self.buffer.buckets[b].data[lo:hi]

    def _set_theta(self, b: int, value: torch.Tensor) -> None:
        lo, hi = self.bounds[b]
        sharded = self.inner.sharded
        if sharded is not None and b in sharded.master:
            sharded.master[b].copy_(value)
        self.buffer.buckets[b].data[lo:hi].copy_(value)

    # -- the step -----------------------------------------------------------------------------------------------

    def micro_batch(self, *, last_micro_batch: bool):
        return self.inner.micro_batch(last_micro_batch=last_micro_batch)

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        self.inner.backward(loss, last_micro_batch=last_micro_batch)

    def step(self, lr: float, *, snapshot_as: int | None = None) -> StepStats:
        inner = self.inner.step(lr)
        self.done += 1
        waited = 0.0
        for p in self.schedule.starting(self.done):
            self._start(p)
        landing = self.schedule.landing(self.done)
        if landing:
            self.inner.synchronize()  # the inner all-gather must not read the shard while we rewrite it
            for p in landing:
                waited += self._land(p)
            self._gather_params()
        shard = self._local_shard(snapshot_as) if snapshot_as is not None else None
        return StepStats(
            grad_norm=inner.grad_norm,
            inter_dc_bytes=self.comm.take_bytes(),
            sync_wait_s=inner.sync_wait_s + waited,
            comm_s=inner.comm_s + waited,
            exposed_s=inner.exposed_s + waited,
            shard=shard,
        )

    def _start(self, fragment: int) -> None:
        handles = []
        settled = self.settled.setdefault(fragment, {}) if self.feedback_held else None
        for b in self.fragments[fragment]:
            lo, hi = self.bounds[b]
            delta = self.scratch[b]
            if settled is not None:  # the residuals this sync's encoding replaces (self.settled)
                for seg, _, c, _ in chunks_across_dcs(delta, self.groups, self.chunk_bytes):
                    settled[(seg, (b, c))] = self.comm.residual(seg, (b, c))
            torch.sub(self.anchor[b], self._theta(b).float(), out=delta[lo:hi])  # 1) delta of the shard
            if self.keep_progress:
                self.started[b].copy_(self._theta(b))
            # 2) all-reduce across DCs: only this rank's segments, all chunks in flight
            handles += start_all_reduce_across_dcs(
                delta, self.groups, self.comm, chunk_bytes=self.chunk_bytes, bucket=b
            )
        self.in_flight[fragment] = handles

    def _land(self, fragment: int) -> float:
        if fragment not in self.in_flight:
            return 0.0  # issued before a restore and dropped; the next sync re-measures it from the anchor
        t0 = time.perf_counter()
        for h in self.in_flight.pop(fragment):
            h.wait()
        waited = time.perf_counter() - t0
        if self.settled.pop(fragment, None):
            self._feedback_copy = None  # this fragment's residuals are now those its sync left
        mu, k = self.cfg.outer_momentum, self.groups.num_dcs
        for b in self.fragments[fragment]:
            lo, hi = self.bounds[b]
            mean = self.scratch[b][lo:hi].div_(k)
            if mu > 0:  # 3) outer Nesterov SGD, as torch.optim.SGD(nesterov=True) computes it
                self.momentum[b].mul_(mu).add_(mean)
                update = mean.add(self.momentum[b], alpha=mu) if self.cfg.nesterov else self.momentum[b]
            else:
                update = mean
            self.anchor[b].sub_(update, alpha=self.cfg.outer_lr)
            # what this datacenter's weights join: the outer weights, or with keep_unsent those plus its own unsent
            # progress (the residual is anchor - theta's part that did not go out: theta = anchor - residual)
            joined = self.anchor[b] if not self.keep_unsent else \
                self.anchor[b] - self._unsent(b).mul_(self.cfg.sparse_error_decay)  # fmt: skip
            if self.keep_progress:  # 4) the outer result plus what this replica trained since the sync started
                self._set_theta(b, torch.sub(self._theta(b).float(), self.started[b]).add_(joined))
            elif self.cfg.overlap_steps:  # 4) the paper's merge of what trained meanwhile with the outer result
                a = self.cfg.mix_alpha
                self._set_theta(b, self._theta(b).float().mul(a).add_(joined, alpha=1 - a))
            else:
                self._set_theta(b, joined)
            self.scratch[b].zero_()
        return waited

    def _unsent(self, b: int) -> torch.Tensor:
        """This rank's residual of bucket ``b``'s last sync over its shard (zeros where a chunk has none)."""
        lo, _ = self.bounds[b]
        out = torch.zeros_like(self.anchor[b])
        base = self.scratch[b].storage_offset() + lo
        for seg, _, c, chunk in chunks_across_dcs(self.scratch[b], self.groups, self.chunk_bytes):
            residual = self.comm.residual(seg, (b, c))
            if residual is not None:
                at = chunk.storage_offset() - base
                out[at : at + chunk.numel()] = residual
        return out

    def _gather_params(self) -> None:
        # 4) every rank of the DC gets the new values (for simplicity every bucket, once per landing step)
        if self.inner.sharded is not None:
            self.inner.sharded.gather_params(async_op=self.inner.overlap)
            return
        for bucket in self.buffer.buckets:
            all_gather_in_dc(bucket.data, self.groups)

    # -- state ----------------------------------------------------------------------------------------------------

    def _outer_pieces(self) -> tuple[StatePiece, ...]:
        pieces = []
        for b, bucket in enumerate(self.buffer.buckets):
            lo, hi = self.bounds[b]
            for s in bucket.slots:
                start, stop = max(lo, s.offset), min(hi, s.stop)
                if start < stop:
                    value = self.anchor[b][start - lo : stop - lo].detach().cpu().clone()
                    mom = self.momentum[b][start - lo : stop - lo].detach().cpu().clone()
                    pieces.append(StatePiece(s.name, start - s.offset, stop - s.offset, value, {"momentum": mom}))
        return tuple(pieces)

    def _local_shard(self, step: int) -> LocalShard:
        """The inner shard, the outer one and, for compressed or sparse outer deltas, the settled error-feedback
        residuals (:attr:`settled`), in :meth:`step`'s snapshots too: they are the datacenter's unsent share of the
        outer update (for the sparse update most of it), which a re-formation from memory keeps for a datacenter
        whose ranks all survive (:func:`~meridian.workers.state.replica_state.assemble`)."""
        if self.inner.sharded is not None:
            inner = self.inner.sharded.local_shard(step)  # this rank's shard is final; no gather needed
        else:
            assert self.inner.optimizer is not None
            inner = replicated_shard(self.inner.optimizer, self.inner._named(), step)
        outer = OuterShard(self.groups.dc, self.done, self._outer_pieces())
        return dataclasses.replace(inner, outer=outer, feedback=self._settled_feedback())

    def _settled_feedback(self) -> tuple[FeedbackShard, ...]:
        """This rank's settled residuals as host copies by parameter element; ``()`` without any."""
        if not self.feedback_held:
            return ()
        if self._feedback_copy is None:
            settled = {key: r for chunks in self.settled.values() for key, r in chunks.items()}
            self._feedback_copy = feedback_shard(self.comm, self.buffer.buckets, self.scratch, self.groups,
                                                 self.chunk_bytes, settled=settled)  # fmt: skip
        return self._feedback_copy

    @property
    def feedback_held(self) -> bool:
        """Whether the outer deltas carry error feedback (compressed or sparse, across datacenters) outside the
        weights (with ``sparse_keep_unsent`` the weights hold it)."""
        return self.comm.feedback_encoding is not None and bool(self.groups.inter_dc) and not self.keep_unsent

    def _load_feedback(self, held: tuple[FeedbackShard, ...]) -> None:
        self._feedback_copy = None
        load_feedback(self.comm, self.buffer.buckets, self.scratch, self.groups, self.chunk_bytes, held)

    def local_shard(self, step: int) -> LocalShard:
        return self._local_shard(step)

    def optimizer_state(self) -> dict[str, Any]:
        """The inner AdamW state of this rank's DC, plus the outer state (collective inside the DC)."""
        state = self.inner.optimizer_state()
        anchor, momentum = self._gather_outer()
        state["diloco"] = {
            "format": DILOCO_STATE_FORMAT,
            "inner_steps_done": self.done,
            "anchor": anchor,
            "momentum": momentum,
        }
        return state

    def _gather_outer(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        n = self.groups.dc_size
        anchor, momentum = {}, {}
        for b, bucket in enumerate(self.buffer.buckets):
            lo, hi = self.bounds[b]
            local = torch.stack([self.anchor[b], self.momentum[b]])  # (2, shard)
            gathered = torch.empty(n * local.numel(), dtype=torch.float32, device=local.device)
            if n > 1:
                all_gather_single(gathered, local.reshape(-1), group=self.groups.intra_dc)
            else:
                gathered.copy_(local.reshape(-1))
            # (n, 2, shard) → (2, padded): the shards lie along the bucket in DC-rank order
            flat = gathered.view(n, 2, hi - lo).transpose(0, 1).reshape(2, -1).cpu()
            for s in bucket.slots:
                anchor[s.name] = flat[0, s.offset : s.stop].reshape(s.param.shape).clone()
                momentum[s.name] = flat[1, s.offset : s.stop].reshape(s.param.shape).clone()
        return anchor, momentum

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Inner state as the HAR engine loads it; the outer state from ``state["diloco"]``. A state without
        one (a checkpoint of another strategy) starts DiLoCo here: outer parameters = the loaded weights."""
        self.drain()
        self.inner.load_optimizer_state(state)
        self.inner.synchronize()
        outer = state.get("diloco")
        if outer is not None and outer.get("format") != DILOCO_STATE_FORMAT:
            raise ValueError(f"DiLoCo state has format {outer.get('format')!r}, expected {DILOCO_STATE_FORMAT!r}")
        self._set_outer(None if outer is None else lambda name, a, b: (
            outer["anchor"][name].reshape(-1)[a:b], outer["momentum"][name].reshape(-1)[a:b]))
        self.done = int(outer["inner_steps_done"]) if outer is not None else 0
        self._load_feedback(feedback_of_full_state(state))

    def _set_outer(self, saved: Callable[[str, int, int], tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """This rank's outer anchor and momentum from ``saved(parameter, start, stop) -> (anchor, momentum)``
        of those flat elements; ``None`` (a state of another strategy): DiLoCo starts here, anchored at the
        current weights with no momentum."""
        for b, bucket in enumerate(self.buffer.buckets):
            if saved is None:
                self.anchor[b].copy_(self._theta(b))
                self.momentum[b].zero_()
                continue
            lo, hi = self.bounds[b]
            self.anchor[b].zero_()
            self.momentum[b].zero_()
            for s in bucket.slots:
                start, stop = max(lo, s.offset), min(hi, s.stop)
                if start < stop:
                    anchor, momentum = saved(s.name, start - s.offset, stop - s.offset)
                    self.anchor[b][start - lo : stop - lo].copy_(anchor)
                    self.momentum[b][start - lo : stop - lo].copy_(momentum)

    def owned_ranges(self) -> list[tuple[str, int, int]] | None:
        """The inner optimizer's ranges and this rank's shard of the outer state; ``None`` with a replicated
        inner optimizer (the full state is then what it holds)."""
        inner = self.inner.owned_ranges()
        if inner is None:
            return None
        outer = [(p.name, p.start, p.stop) for p in self._outer_pieces()]
        return inner + [r for r in outer if r not in set(inner)]

    def load_local_shard(self, shard: LocalShard) -> None:
        """:meth:`load_optimizer_state` from this rank's ranges only (what ``owned_ranges`` names)."""
        self.drain()
        self.inner.load_local_shard(shard)
        self.inner.synchronize()
        outer = shard.outer

        def saved(name: str, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
            assert outer is not None
            piece = cut(outer.pieces, name, a, b)
            return piece.value, piece.moments["momentum"]

        self._set_outer(None if outer is None else saved)
        self.done = shard.outer.inner_steps_done if shard.outer is not None else 0
        self._load_feedback(shard.feedback)

    def optimizer_state_nbytes(self) -> int:
        """Inner AdamW state plus this rank's shard of the outer parameters and momentum."""
        outer = sum(a.numel() * a.element_size() * 2 for a in self.anchor)
        return self.inner.optimizer_state_nbytes() + outer

    def drain(self) -> None:
        """Wait for every outer all-reduce in flight without applying it (its delta is not lost: the next
        sync of that fragment measures from the same anchor)."""
        for handles in self.in_flight.values():
            for h in handles:
                h.wait()
        self.in_flight.clear()
        for chunks in self.settled.values():  # the residuals go back to what they were before those syncs
            for (seg, key), residual in chunks.items():
                if residual is not None:
                    self.comm.set_residual(seg, key, residual)
                else:
                    self.comm.drop_residual(seg, key)
        self.settled.clear()
        self._feedback_copy = None
        for s in self.scratch:
            s.zero_()

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        self.drain()
        self.inner.close()
