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

    inner: FSDP2 inside this DC only (FSDPHierarchicalSync without its inter-DC step: reduce-scatter,
           AdamW on this rank's rows; FSDP2 all-gathers them at the next forward; no WAN)
    after inner step t, for each fragment whose sync starts at t:
        # 1) delta of this rank's rows:  d = anchor - theta                 (fp32, this rank's rows only)
        # 2) sum d with the holders of the same rows in the other DCs (shard_exchange's pieces, even and
        #    uneven DCs; InterDCComm: compression, byte count, WAN emulation), in flight for overlap_steps steps
    for each fragment landing at t:
        # 3) outer Nesterov SGD on the rows:  m = mu*m + mean(d);  anchor -= lr_out * (mean(d) + mu*m)
        # 4) theta = anchor, or with overlap the paper's "mix": alpha*theta + (1-alpha)*anchor (or merge
        #    "keep-progress": theta = anchor + theta - theta_start, what trained since the sync started kept)

Fragments are contiguous runs of whole parameters in the FSDP units' order, balanced by element count
(:func:`~meridian.workers.sync.diloco_schedule.split_fragments`).

Sparse outer update (``sync.diloco.sparse_density``; SparseLoCo, Sarfi et al. 2025, arXiv:2508.15706): step 2
sends, of every chunk of the rank's rows, only the top-k of each block in 2-8 bits
(:mod:`meridian.workers.sync.sparse_codec`); what was not sent stays in the rank's error-feedback residual for the
chunk's next sync (the residuals of a sync in flight are saved as they were before it: a restore drops that sync and
measures its delta again), or with ``sparse_keep_unsent`` in the weights step 4 writes: ``anchor - residual`` in
place of ``anchor``. Each rank sparsifies its own rows; nothing is gathered to one rank.

Only step 2 crosses DCs, carrying 1/N of the fragment per rank (N = ranks in the DC), once per H/P steps.
The outer state (anchor, momentum) is sharded like FSDP2's parameters and the inner AdamW state, so it costs 2/N of
the model per rank, in fp32; one scratch buffer of the rank's rows holds deltas in flight. Inner gradients are the
DC's sum of the ranks' global-batch shares times ``data-parallel ranks / dc_size``, applied once to the synced
gradients before clipping: the DC's mean gradient when samples are split evenly over the replicas
(:func:`meridian.workers.data.text.rank_slice` splits them within one sample). The outer average weighs every DC
equally, as the paper averages its replicas.

It talks across DCs through step 2 only, over the groups of :func:`~meridian.workers.sync.shard_exchange.plan_exchanges`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from meridian.workers.contracts.config import Compression, OptimConfig, OuterMerge, SyncConfig, SyncStrategy
from meridian.workers.distributed.layout import DCGroups, Segment
from meridian.workers.distributed.shard_rows import chunk_rows
from meridian.workers.state.replica_state import (
    DILOCO_STATE_FORMAT,
    FeedbackShard,
    LocalShard,
    OuterShard,
    StatePiece,
    cut,
    feedback_of_full_state,
    host_copy,
)
from meridian.workers.sync.diloco_schedule import FragmentSchedule, split_fragments
from meridian.workers.sync.engine import GradientSync, StepStats
from meridian.workers.sync.fsdp_har import FSDPHierarchicalSync
from meridian.workers.sync.inter_dc import InterDCComm
from meridian.workers.sync.shard_exchange import Exchange, Flight, ShardParam, Unit, plan_exchanges
from meridian.workers.sync.sparse_codec import sparse_codec_of
from meridian.workers.wan.emulator import WanEmulator


def intra_dc_view(groups: DCGroups) -> DCGroups:
    """The same groups with no inter-DC ones: a sync over this view reduces inside the DC and stops there."""
    view = copy.copy(groups)
    view.inter_dc = {}
    return view


def _fragment_exchanges(
    units: list[Unit], params: list[ShardParam], fragment: int, dc_size: int
) -> list[tuple[int, Exchange]]:
    """``(unit index, exchange)`` of the rows of ``params`` (one fragment): each unit's exchanges cut to those
    parameters' regions of the unit's row layout (``dc_size`` ranks pad each to ``ceil(rows / N)`` rows), their
    segments named by unit and fragment (the chunks' keys)."""
    regions: dict[int, list[tuple[int, int]]] = {}
    for p in params:
        regions.setdefault(p.unit, []).append((p.offset, p.offset + chunk_rows(p.n0, dc_size) * p.row_numel))
    out = []
    for unit in units:
        mine = regions.get(unit.index)
        if not mine:
            continue
        for x in unit.exchanges:
            spans = []
            for a, b in x.spans:
                for lo, hi in mine:
                    x0, y0 = max(a, lo), min(b, hi)
                    if x0 < y0:
                        if spans and spans[-1][1] == x0:
                            spans[-1] = (spans[-1][0], y0)
                        else:
                            spans.append((x0, y0))
            if spans:
                seg = Segment(unit.index, fragment, x.segment.owners)
                out.append((unit.index, Exchange(seg, x.group, spans)))
    return out


def _local_parts(p: ShardParam, start: int, n: int) -> list[tuple[int, int]]:
    """``(first local element, elements)`` of the whole parameter's elements ``[start, start + n)``."""
    out, at = [], 0
    for a, b in p.ranges:
        x, y = max(a, start), min(b, start + n)
        if x < y:
            out.append((at + x - a, y - x))
        at += b - a
    return out


class DiLoCoSync(GradientSync):
    """FSDP2 inside each DC every step; every H steps (per fragment) an outer Nesterov step across DCs.

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
        broadcast_params: bool = True,
        shard: Callable[..., list[FSDPModule]] | None = None,
        reshard_after_forward: bool = True,
    ) -> None:
        if not sync.strategy.is_diloco:
            raise ValueError(
                f"DiLoCoSync needs sync.strategy 'diloco' or 'streaming-diloco', got {sync.strategy.value!r}; "
                "use build_sync to pick the engine"
            )
        cfg = sync.outer
        self.cfg, self.groups = cfg, groups
        inner_sync = dataclasses.replace(
            sync, strategy=SyncStrategy.HIERARCHICAL, compression=Compression.NONE, diloco=None,
            delay_one_step=False, local_lookahead=False,
        )
        # Inner gradients: the DC's sum of its ranks' global-batch shares, times (data-parallel ranks / DC
        # ranks), once, on the synced gradients (not on the loss).
        self.grad_scale = len(groups.world_ranks) / groups.dc_size
        self.inner = FSDPHierarchicalSync(model, intra_dc_view(groups), inner_sync, optim, grad_scale=self.grad_scale,
                                          broadcast_params=broadcast_params, shard=shard, across_dcs=False,
                                          reshard_after_forward=reshard_after_forward)
        self.model = self.inner.model
        self.params: list[ShardParam] = self.inner.params
        self.units = [Unit(u.index, u.module, u.params) for u in self.inner.units]  # the outer step's exchanges
        if groups.num_dcs > 1:
            plan_exchanges(self.units, groups)
        frags = split_fragments([math.prod(p.param.shape) for p in self.params], cfg.fragments, what="parameters")
        self.fragments: list[list[ShardParam]] = [[self.params[i] for i in f] for f in frags]
        """Each fragment's parameters (contiguous in the units' order)."""
        self.exchanges = [_fragment_exchanges(self.units, f, i, groups.dc_size) for i, f in enumerate(self.fragments)]
        self.schedule = FragmentSchedule(cfg.inner_steps, cfg.fragments, cfg.overlap_steps, cfg.warmup_steps)
        self.keep_unsent = cfg.sparse_keep_unsent
        """The sparse residual lives in the weights (``sparse_keep_unsent``): the comm keeps each sync's residual
        only until it lands, and never adds it to the next delta, which already holds it."""
        self.comm = InterDCComm(sync.compression, emulator=emulator, sparse=sparse_codec_of(cfg),
                                feedback_decay=0.0 if self.keep_unsent else cfg.sparse_error_decay)  # the only inter-DC traffic
        closing = cfg.final_average.compression
        self.closing = InterDCComm(closing, emulator=emulator) if closing is not None and groups.num_dcs > 1 else None
        """The last step's average of the datacenters' weights (``final_average``): its own encoding and count."""
        self.chunk_bytes = sync.inter_dc_chunk_mb * 2**20
        self.chunk_elems = max(1, int(self.chunk_bytes) // 4)  # deltas are fp32
        # Outer state of this rank's rows, fp32 (the papers keep the outer parameters in full precision).
        self.anchor = [p.local.detach().float().clone() for p in self.params]
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        device = self.anchor[0].device if self.anchor else torch.device("cpu")
        self.scratch = {u.index: torch.zeros(sum(chunk_rows(p.n0, groups.dc_size) * p.row_numel for p in u.params),
                                             dtype=torch.float32, device=device) for u in self.units}  # fmt: skip
        """Each unit's deltas in its row layout (the reduce-scatter output's: the exchanges' spans index it)."""
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.keep_progress = cfg.overlap_steps > 0 and cfg.merge is OuterMerge.KEEP_PROGRESS
        self.started = [torch.empty_like(a) for a in self.anchor] if self.keep_progress else []
        """keep-progress: this rank's rows as they were when their fragment's sync started."""
        self.in_flight: dict[int, list[tuple[Exchange, Flight]]] = {}
        self.settled: dict[int, dict[tuple[Segment, Hashable], torch.Tensor | None]] = {}
        """Per fragment in flight: each chunk's error-feedback residual from before that sync encoded it. A restore
        drops a sync in flight and the next one measures its delta again from the same anchor, so the state to
        save (and to go back to) is this one, not the residual of a delta that was never applied."""
        self._feedback_copy: tuple[FeedbackShard, ...] | None = None
        """Host copy of the settled residuals, taken once per landing (they change only then), for the snapshots."""
        self.done = 0
        """Inner steps completed: the schedule's clock, saved with the state."""
        # Every exchange's first receive, posted now (in fragment order, the same on every owner): a fragment's
        # first sync then flows one way, as every later one does, instead of paying a round trip.
        for f in range(len(self.fragments)):
            for x, _, c, chunk in self._chunks(f):
                self.comm.post_receive(chunk, x.group, x.segment, key=(x.segment.lo, c))

    def _chunks(self, fragment: int):
        """``(exchange, unit index, chunk index, a tensor of the chunk's size)`` of every chunk ``fragment`` sends."""
        for u, x in self.exchanges[fragment]:
            n = sum(b - a for a, b in x.spans)
            for c, at in enumerate(range(0, n, self.chunk_elems)):
                yield x, u, c, self.scratch[u][: min(self.chunk_elems, n - at)]

    def chunk_keys(self) -> list[tuple[Segment, Hashable]]:
        """``(segment, key)`` of every chunk the outer sync sends, in fragment order: what its error-feedback residual
        is kept under (:meth:`InterDCComm.residual`)."""
        return [(x.segment, (x.segment.lo, c)) for f in range(len(self.fragments)) for x, _, c, _ in self._chunks(f)]

    def chunk_layout(self) -> list[tuple[int, tuple[Segment, Hashable], list[tuple[str, int, int]]]]:
        """``(fragment, (segment, key), parts)`` of every chunk this rank sends, parts as ``(parameter, first element
        of the whole parameter, elements)`` in the chunk's order: the same elements on every holder of the chunk."""
        out: list[tuple[int, tuple[Segment, Hashable], list[tuple[str, int, int]]]] = []
        for f in range(len(self.fragments)):
            for x, c, p, start, n, _ in self._residual_parts(f, lambda seg, key: None):
                key = (x.segment, (x.segment.lo, c))
                if not out or out[-1][1] != key:
                    out.append((f, key, []))
                out[-1][2].append((p.name, start, n))
        return out

    # -- the step -----------------------------------------------------------------------------------------------

    def micro_batch(self, *, last_micro_batch: bool):
        return self.inner.micro_batch(last_micro_batch=last_micro_batch)

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        self.inner.backward(loss, last_micro_batch=last_micro_batch)

    def step(self, lr: float, *, snapshot_as: int | None = None, last: bool = False) -> StepStats:
        inner = self.inner.step(lr)
        self.done += 1
        waited = 0.0
        if last and self.closing is not None:
            waited += self._average()
        else:
            for f in self.schedule.starting(self.done):
                self._start(f)
            for f in self.schedule.landing(self.done):
                waited += self._land(f)
        shard = self._local_shard(snapshot_as) if snapshot_as is not None else None
        return StepStats(
            grad_norm=inner.grad_norm,
            inter_dc_bytes=self.comm.take_bytes() + (self.closing.take_bytes() if self.closing is not None else 0),
            sync_wait_s=inner.sync_wait_s + waited,
            comm_s=inner.comm_s + waited,
            exposed_s=inner.exposed_s + waited,
            intra_dc_comm_s=inner.intra_dc_comm_s,
            shard=shard,
        )

    def _start(self, fragment: int) -> None:
        if self.feedback_held:  # the residuals this sync's encoding replaces (self.settled)
            settled = self.settled.setdefault(fragment, {})
            for x, _, c, _ in self._chunks(fragment):
                key = (x.segment.lo, c)
                settled[(x.segment, key)] = self.comm.residual(x.segment, key)
        with torch.no_grad():
            for p in self.fragments[fragment]:  # 1) delta of this rank's rows
                i = self._index[id(p)]
                torch.sub(self.anchor[i], p.local.float(), out=p.in_reduced(self.scratch[p.unit]))
                if self.keep_progress:
                    self.started[i].copy_(p.local)
        # 2) summed with the other DCs' holders of the same rows: every chunk in flight
        self.in_flight[fragment] = [(x, x.start(self.scratch[u], self.comm, self.chunk_bytes))
                                    for u, x in self.exchanges[fragment]]  # fmt: skip

    def _land(self, fragment: int) -> float:
        if fragment not in self.in_flight:
            return 0.0  # issued before a restore and dropped; the next sync re-measures it from the anchor
        t0 = time.perf_counter()
        flights = self.in_flight.pop(fragment)
        for (x, flight), (u, _) in zip(flights, self.exchanges[fragment], strict=True):
            x.finish(flight, self.scratch[u])
        waited = time.perf_counter() - t0
        if self.settled.pop(fragment, None):
            self._feedback_copy = None  # this fragment's residuals are now those its sync left
        unsent = self._unsent(fragment) if self.keep_unsent else {}
        mu, k = self.cfg.outer_momentum, self.groups.num_dcs
        with torch.no_grad():
            for p in self.fragments[fragment]:
                i = self._index[id(p)]
                mean = p.in_reduced(self.scratch[p.unit]).div_(k)
                if mu > 0:  # 3) outer Nesterov SGD, as torch.optim.SGD(nesterov=True) computes it
                    self.momentum[i].mul_(mu).add_(mean)
                    update = mean.add(self.momentum[i], alpha=mu) if self.cfg.nesterov else self.momentum[i]
                else:
                    update = mean
                self.anchor[i].sub_(update, alpha=self.cfg.outer_lr)
                # what this datacenter's weights join: the outer weights, or with keep_unsent those plus its own
                # unsent progress (the residual is anchor - theta's part that did not go out: theta = anchor - residual)
                joined = self.anchor[i] if not self.keep_unsent else \
                    self.anchor[i] - unsent[i].mul_(self.cfg.sparse_error_decay)  # fmt: skip
                if self.keep_progress:  # 4) the outer result plus what this replica trained since the sync started
                    p.local.copy_(torch.sub(p.local.float(), self.started[i]).add_(joined))
                elif self.cfg.overlap_steps:  # 4) the paper's merge of what trained meanwhile with the outer result
                    a = self.cfg.mix_alpha
                    p.local.copy_(p.local.float().mul(a).add_(joined, alpha=1 - a))
                else:
                    p.local.copy_(joined)
                mean.zero_()
        return waited

    def _average(self) -> float:
        """The job's last step (``final_average``): land every sync in flight, then give every datacenter the mean of
        their weights. Each rank sends its rows' delta from the outer weights, plus what its error feedback would add
        to the next one (``decay × residual``: the progress it has not sent yet; none with ``sparse_keep_unsent``,
        whose weights hold it), in the ``final_average`` encoding; the outer weights become the result. Returns the
        seconds it waited."""
        t0 = time.perf_counter()
        for f in sorted(self.in_flight):
            self._land(f)
        decay = self.comm.feedback_decay
        with torch.no_grad():
            for f, params in enumerate(self.fragments):
                unsent = self._unsent(f) if decay else {}
                for p in params:
                    i = self._index[id(p)]
                    delta = torch.sub(self.anchor[i], p.local.float(), out=p.in_reduced(self.scratch[p.unit]))
                    if decay:
                        delta.add_(unsent[i], alpha=decay)
            assert self.closing is not None
            flights = [(u, x, x.start(self.scratch[u], self.closing, self.chunk_bytes))
                       for f in range(len(self.fragments)) for u, x in self.exchanges[f]]  # fmt: skip
            for u, x, flight in flights:
                x.finish(flight, self.scratch[u])
            k = self.groups.num_dcs
            for p in self.params:
                i = self._index[id(p)]
                self.anchor[i].sub_(p.in_reduced(self.scratch[p.unit]).div_(k))
                p.local.copy_(self.anchor[i])
        self.comm.clear_residuals()  # what they held is in the average now
        self._feedback_copy = None
        for scratch in self.scratch.values():
            scratch.zero_()
        return time.perf_counter() - t0

    def _residual_parts(self, fragment: int, residual_of: Callable[[Segment, Hashable], torch.Tensor | None]):
        """``(parameter, first whole element, elements, values or None)`` of every chunk ``fragment`` sends, the
        chunk's residual ``residual_of(segment, key)`` cut along the chunk's parts."""
        by_unit = {u.index: u.params for u in self.units}
        for u, x in self.exchanges[fragment]:
            for c, parts in enumerate(x.chunk_parts(by_unit[u], self.chunk_elems)):
                residual = residual_of(x.segment, (x.segment.lo, c))
                at = 0
                for p, start, n in parts:
                    yield x, c, p, start, n, None if residual is None else residual[at : at + n]
                    at += n

    def _unsent(self, fragment: int) -> dict[int, torch.Tensor]:
        """This rank's residual of ``fragment``'s last sync, by parameter index, shaped like its rows (zeros where a
        chunk has none)."""
        out = {self._index[id(p)]: torch.zeros_like(self.anchor[self._index[id(p)]]) for p in self.fragments[fragment]}
        for _, _, p, start, _, value in self._residual_parts(fragment, self.comm.residual):
            if value is None:
                continue
            flat, at = out[self._index[id(p)]].view(-1), 0
            for lo, m in _local_parts(p, start, value.numel()):
                flat[lo : lo + m] = value[at : at + m]
                at += m
        return out

    # -- state ----------------------------------------------------------------------------------------------------

    def _outer_pieces(self) -> tuple[StatePiece, ...]:
        pieces = []
        for p, anchor, mom in zip(self.params, self.anchor, self.momentum, strict=True):
            value, moment, at = host_copy(anchor), host_copy(mom), 0
            for a, b in p.ranges:
                pieces.append(StatePiece(p.name, a, b, value[at : at + b - a], {"momentum": moment[at : at + b - a]}))
                at += b - a
        return tuple(pieces)

    def _local_shard(self, step: int) -> LocalShard:
        """The inner shard, the outer one and, for compressed or sparse outer deltas, the settled error-feedback
        residuals (:attr:`settled`), in :meth:`step`'s snapshots too: they are the datacenter's unsent share of the
        outer update (for the sparse update most of it), which a re-formation from memory keeps for a datacenter
        whose ranks all survive (:func:`~meridian.workers.state.replica_state.assemble`)."""
        inner = self.inner.local_shard(step)
        outer = OuterShard(self.groups.dc, self.done, self._outer_pieces())
        return dataclasses.replace(inner, outer=outer, feedback=self._settled_feedback())

    def _settled_feedback(self) -> tuple[FeedbackShard, ...]:
        """This rank's settled residuals as host copies by parameter element; ``()`` without any."""
        if not self.feedback_held:
            return ()
        if self._feedback_copy is None:
            settled = {key: r for chunks in self.settled.values() for key, r in chunks.items()}

            def residual_of(seg: Segment, key: Hashable) -> torch.Tensor | None:
                return settled[(seg, key)] if (seg, key) in settled else self.comm.residual(seg, key)

            out = [StatePiece(p.name, start, start + n, host_copy(value) if value is not None else torch.zeros(n))
                   for f in range(len(self.fragments))
                   for _, _, p, start, n, value in self._residual_parts(f, residual_of)]  # fmt: skip
            encoding = self.comm.feedback_encoding
            assert encoding is not None
            self._feedback_copy = (FeedbackShard(self.groups.dc, encoding, tuple(out)),)
        return self._feedback_copy

    @property
    def feedback_held(self) -> bool:
        """Whether the outer deltas carry error feedback (compressed or sparse, across datacenters) outside the
        weights (with ``sparse_keep_unsent`` the weights hold it)."""
        return self.comm.feedback_encoding is not None and self.groups.num_dcs > 1 and not self.keep_unsent

    def _load_feedback(self, held: tuple[FeedbackShard, ...]) -> None:
        """Each chunk's residual from ``held``'s pieces of this datacenter and encoding (zero where they hold none)."""
        self._feedback_copy = None
        self.comm.clear_residuals()
        mine = next((f for f in held if f.dc == self.groups.dc and f.compression == self.comm.feedback_encoding), None)
        if mine is None or not self.feedback_held:
            return
        chunks: dict[tuple[Segment, Hashable], list[torch.Tensor]] = {}
        for f in range(len(self.fragments)):
            for x, c, p, start, n, _ in self._residual_parts(f, lambda seg, key: None):
                try:
                    value = cut(mine.pieces, p.name, start, start + n).value.reshape(-1)
                except ValueError:  # a layout or datacenter the saved state does not cover: zero
                    value = torch.zeros(n)
                chunks.setdefault((x.segment, (x.segment.lo, c)), []).append(value)
        device = self.scratch[self.units[0].index].device if self.units else torch.device("cpu")
        for (seg, key), values in chunks.items():
            self.comm.set_residual(seg, key, torch.cat(values).to(device))

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
        mine = {p.name: (p.ranges, host_copy(a), host_copy(m))
                for p, a, m in zip(self.params, self.anchor, self.momentum, strict=True)}  # fmt: skip
        gathered: list[Any] = [mine]
        if self.groups.dc_size > 1:
            gathered = [None] * self.groups.dc_size
            dist.all_gather_object(gathered, mine, group=self.groups.intra_dc)
        shapes = {p.name: p.param.shape for p in self.params}
        anchor = {n: torch.zeros(math.prod(s)) for n, s in shapes.items()}
        momentum = {n: torch.zeros(math.prod(s)) for n, s in shapes.items()}
        for part in gathered:
            for name, (ranges, a_val, m_val) in part.items():
                at = 0
                for a, b in ranges:
                    anchor[name][a:b] = a_val[at : at + b - a]
                    momentum[name][a:b] = m_val[at : at + b - a]
                    at += b - a
        return ({n: t.view(shapes[n]) for n, t in anchor.items()},
                {n: t.view(shapes[n]) for n, t in momentum.items()})  # fmt: skip

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Inner state as the FSDP2 engine loads it; the outer state from ``state["diloco"]``. A state without
        one (a checkpoint of another strategy) starts DiLoCo here: outer parameters = the loaded weights."""
        self.drain()
        self.inner.load_optimizer_state(state)
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
        with torch.no_grad():
            for p, anchor, mom in zip(self.params, self.anchor, self.momentum, strict=True):
                if saved is None:
                    anchor.copy_(p.local)
                    mom.zero_()
                    continue
                at, a_flat, m_flat = 0, anchor.view(-1), mom.view(-1)
                for a, b in p.ranges:
                    value, moment = saved(p.name, a, b)
                    a_flat[at : at + b - a].copy_(value.reshape(-1))
                    m_flat[at : at + b - a].copy_(moment.reshape(-1))
                    at += b - a

    def owned_ranges(self) -> list[tuple[str, int, int]]:
        """This rank's rows: the inner optimizer's ranges, which the outer state shares."""
        return self.inner.owned_ranges()

    def load_local_shard(self, shard: LocalShard) -> None:
        """:meth:`load_optimizer_state` from this rank's ranges only (what ``owned_ranges`` names)."""
        self.drain()
        self.inner.load_local_shard(shard)
        outer = shard.outer

        def saved(name: str, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
            assert outer is not None
            piece = cut(outer.pieces, name, a, b)
            return piece.value, piece.moments["momentum"]

        self._set_outer(None if outer is None else saved)
        self.done = outer.inner_steps_done if outer is not None else 0
        self._load_feedback(shard.feedback)

    def load_weights(self, model: nn.Module, params: dict[str, torch.Tensor]) -> None:
        self.inner.load_weights(model, params)

    def optimizer_state_nbytes(self) -> int:
        """Inner AdamW state plus this rank's rows of the outer parameters and momentum."""
        outer = sum(a.numel() * a.element_size() * 2 for a in self.anchor)
        return self.inner.optimizer_state_nbytes() + outer

    def exchange_buffer_nbytes(self) -> int:
        """Bytes the outer exchanges hold between steps: the deltas' scratch rows and the receives posted ahead."""
        return sum(s.numel() * s.element_size() for s in self.scratch.values()) + self.comm.posted_nbytes

    def drain(self) -> None:
        """Wait for every outer sum in flight without applying it (its delta is not lost: the next sync of that
        fragment measures from the same anchor)."""
        for flights in self.in_flight.values():
            for _, flight in flights:
                for h in flight.handles:
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
        for s in self.scratch.values():
            s.zero_()

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        self.drain()
        self.inner.close()
