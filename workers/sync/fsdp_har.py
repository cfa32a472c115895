"""HAR on FSDP2: sharded inside each datacenter by torch, summed across datacenters by Meridian.

Per step, on every rank (``last`` = the last micro-batch; earlier ones accumulate unsharded gradients and
communicate nothing)::

    forward          FSDP2 all-gathers each block's parameters inside the DC (kept or freed after it:
                     ``reshard_after_forward``)
    backward(last)   as each FSDP unit's gradients are done:
                     # 1) reduce-scatter inside the DC     FSDP2: this rank keeps the DC's sum of its rows
                     # 2) all-reduce the shard across DCs  FSDP2's all-reduce hook: each piece of those rows with
                     #                                      its holders in the other DCs, chunked, all in flight,
                     #                                      through InterDCComm (compression, bytes, WAN emulation)
    step(lr)         wait for 2); clip (one norm, the same bits in every DC) and AdamW, on this rank's rows only
                     # 3) all-gather inside the DC         FSDP2, at the next forward: the updated parameters

Only step 2 crosses the slow link, carrying this rank's rows (1/N of the model for N ranks in its DC), once.
Parameters, gradients and optimizer state are sharded inside a DC and replicated across DCs: a whole replica of
the state in every datacenter, which is what recovery rebuilds from (:mod:`meridian.workers.state.replica_state`).
Datacenters of any sizes (:mod:`meridian.workers.sync.shard_exchange`). With ``overlap`` off, step 2 starts in
``step`` instead of during backward.

With ``delay_one_step`` step t's sum runs behind the whole of step t+1 (forward included) and step t+1 applies
it: every replica still applies the exact global-batch gradient of every step, in order, one step late (step 0
applies none; a snapshot or re-formation drops the sum in flight). With ``local_lookahead`` as well, step t+1
does not compute at stale parameters::

    step(lr) at step t
        step t's sum started (backward), this rank's DC-summed rows kept (before step 2)
        commit: wait for step t-1's sum; AdamW on the committed fp32 rows with it (step t-1's lr)
        look ahead: parameters <- AdamW(committed, DC-summed rows × ranks / DC ranks), moments untouched
    synchronize()
        land the sum in flight, commit it, parameters <- committed: nothing is dropped

The first ``lookahead_after`` steps sync exactly; with ``lookahead_when_exposed`` (armed) the look-ahead takes
over only if the exact steps before waited for the sync and a trial of it stepped faster
(:mod:`meridian.workers.sync.lookahead_decision`).

The optimizer is torch's AdamW over plain tensors of this rank's rows (fused on CUDA): the FSDP2 shards' own
local tensors, or with the look-ahead their committed fp32 copies. Its state is exactly ``(parameter, start,
stop)`` element ranges of each flattened parameter, the form snapshots, the survivors' exchange and durable
checkpoints speak.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from meridian.workers.contracts.config import Compression, OptimConfig, SyncConfig, lookahead_start
from meridian.workers.distributed.layout import DCGroups
from meridian.workers.optim.adamw import (
    FULL_STATE_FORMAT,
    MOMENTS,
    check_full_state,
    make_adamw,
    param_groups,
    set_lr,
    step_counter,
)
from meridian.workers.optim.lookahead import lookahead_adamw
from meridian.workers.parallel.fsdp import TimedReduceScatter, apply_fsdp, dc_mesh
from meridian.workers.state.replica_state import (
    FeedbackShard,
    LocalShard,
    StatePiece,
    cut,
    feedback_of_full_state,
    host_copy,
    piece_of,
)
from meridian.workers.sync.engine import GradientSync, StepStats, broadcast_parameters
from meridian.workers.sync.inter_dc import InterDCComm
from meridian.workers.sync.lookahead_decision import LookaheadChooser, LookaheadDecision
from meridian.workers.sync.shard_exchange import (
    Flight,
    NormPlan,
    ShardParam,
    Unit,
    describe_units,
    plan_exchanges,
)
from meridian.workers.wan.emulator import WanEmulator


@dataclass
class _Sync:
    """One step's gradient sum: each unit's reduce-scatter output and its exchanges in flight."""

    reduced: dict[int, torch.Tensor] = field(default_factory=dict)
    flights: dict[int, list[Flight]] = field(default_factory=dict)
    local: dict[int, torch.Tensor] = field(default_factory=dict)
    """Look-ahead: each unit's rows as summed inside the DC, before step 2."""
    started_at: float | None = None


class FSDPHierarchicalSync(GradientSync):
    """FSDP2 inside each datacenter, Meridian's inter-DC sum of each rank's gradient rows on top."""

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
        reshard_after_forward: bool = True,
        shard: Callable[..., list[FSDPModule]] | None = None,
        across_dcs: bool = True,
    ) -> None:
        """``across_dcs=False``: sum inside the datacenter only (DiLoCo's inner step; no inter-DC exchange).
        ``reshard_after_forward``: the units' own (``shard`` applies it; without ``shard`` this engine does); off, they
        also stay gathered after each backward but the step's last, so a step gathers each unit once."""
        self.groups, self.optim_cfg = groups, optim
        self.grad_scale = grad_scale
        self.overlap = sync.overlap
        self.chunk_bytes = sync.inter_dc_chunk_mb * 2**20
        self.delayed, self.lookahead = sync.delay_one_step, sync.local_lookahead
        if grad_scale != 1.0 and self.delayed:
            raise ValueError("grad_scale applies to an exact (not delay_one_step) sync only")
        device = next(model.parameters()).device
        if broadcast_params:  # every replica starts from the same weights (whole, before sharding)
            broadcast_parameters(model, src=groups.world_ranks[0], group=groups.world)
        self.reduce_scatter = TimedReduceScatter()
        # FSDP2 inside the DC; ``shard`` does it for a job that parallelises more (tensor/pipeline parallelism,
        # compile, activation checkpointing: :mod:`meridian.workers.parallel.parallelize`), returning the units
        fsdp_units = shard(model, reduce_scatter=self.reduce_scatter) if shard is not None else apply_fsdp(
            model, dc_mesh(groups.intra_dc, device), reshard_after_forward=reshard_after_forward,
            reduce_scatter=self.reduce_scatter)
        self.model = model
        self.root = fsdp_units[-1]
        self.keep_gathered = not reshard_after_forward
        self.comm = InterDCComm(sync.compression, emulator=emulator)
        self.units: list[Unit] = describe_units(model, fsdp_units, groups)
        if across_dcs and (groups.num_dcs > 1 or groups.has_siblings):  # (siblings make their groups together: collective)
            plan_exchanges(self.units, groups)
        self.norms = NormPlan(self.units, groups)
        for unit in self.units:
            unit.module.set_all_reduce_hook(lambda reduced, unit=unit: self._reduced(unit, reduced))
        self.params: list[ShardParam] = [p for u in self.units for p in u.params]
        # The optimizer's tensors: the shards' own rows, or (look-ahead) their committed fp32 copies.
        self.tensors = [p.local.detach().clone() if self.lookahead else p.local for p in self.params]
        named = [(p.name, t) for p, t in zip(self.params, self.tensors, strict=True)]
        self.optimizer = make_adamw(param_groups(named, model, optim), optim)
        self._decay = {id(t): g["weight_decay"] for g in self.optimizer.param_groups for t in g["params"]}
        self.steps = 0
        """Committed optimizer steps (AdamW's bias-correction count)."""
        self.clip_coef: torch.Tensor | None = None
        """The clipping coefficient of the last committed update (the look-ahead clips with it)."""
        self.exact_first = lookahead_start(sync.lookahead_after, optim.warmup_steps) if self.lookahead else 0
        self.chooser = (LookaheadChooser(sync.lookahead_when_exposed, self.exact_first)
                        if self.lookahead and sync.lookahead_when_exposed is not None else None)
        self._scale = len(groups.world_ranks) / groups.dc_size
        """Look-ahead: a DC's sum → an estimate of the global-batch sum (samples split evenly over ranks)."""
        self._current = _Sync()
        """The sum the backward under way starts."""
        self._in_flight: _Sync | None = None
        """One step late: the sum the last ``step`` started and the next applies."""
        self._in_flight_lr = 0.0

    @property
    def late(self) -> bool:
        """Whether this step's sum is applied one step late (``delay_one_step``, after the exact first steps;
        armed, during the trial and once the look-ahead was kept)."""
        if not self.delayed:
            return False
        if self.chooser is not None:
            return self.chooser.lookahead
        return self.steps >= self.exact_first

    # -- one step ----------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        # Earlier micro-batches accumulate unsharded gradients; the last reduce-scatters them (and, through the
        # hook, starts the inter-DC sum).
        self.root.set_requires_gradient_sync(last_micro_batch)
        if self.keep_gathered:  # gathered until the step's last backward, which reshards them for the update
            self.root.set_reshard_after_backward(last_micro_batch)
        loss.backward()

    def _reduced(self, unit: Unit, reduced: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: ``reduced`` holds this rank's DC-summed rows of ``unit`` (padded)."""
        sync = self._current
        sync.reduced[unit.index] = reduced
        if self.lookahead and self.late:  # step 2 sums in place: keep this DC's own sum for the look-ahead
            sync.local[unit.index] = reduced.clone()
        if self.overlap:
            self._start(sync, unit)

    def _start(self, sync: _Sync, unit: Unit) -> None:
        if sync.started_at is None:
            sync.started_at = time.perf_counter()
        sync.flights[unit.index] = [x.start(sync.reduced[unit.index], self.comm, self.chunk_bytes)
                                    for x in unit.exchanges]  # fmt: skip

    def step(self, lr: float, *, snapshot_as: int | None = None, last: bool = False) -> StepStats:
        t0 = time.perf_counter()
        current, self._current = self._current, _Sync()
        missing = [u.index for u in self.units if u.index not in current.reduced]
        if missing:
            raise RuntimeError(f"step() without the last micro-batch's backward: units {missing} reduced nothing")
        if not self.overlap:
            for unit in self.units:
                self._start(current, unit)
        deciding = self.chooser is not None and self.chooser.decision is None
        if deciding:
            assert self.chooser is not None
            self.chooser.due_at(self.steps)  # fixed at the first step, after any restore
        late = self.late
        apply = current
        commit_lr = lr
        if late:
            commit_lr = self._in_flight_lr if self.lookahead else lr
            self._in_flight_lr = lr
            apply, self._in_flight = self._in_flight, current
        comm_s = exposed_s = 0.0
        intra_dc_s = self.reduce_scatter.take()
        norm = torch.zeros((), device=self.params[0].local.device)
        if apply is not None:
            started = apply.started_at if apply.started_at is not None else t0
            self._land(apply)
            done = time.perf_counter()
            exposed_s = done - t0  # what this step waited for the sum, its start without overlap included
            comm_s = done - started if self.groups.num_dcs > 1 else 0.0
            norm = self._commit(commit_lr, write_params=not (self.lookahead and late))
        # the in-DC reduce-scatters held the training thread during backward (on CPU; a GPU's run on FSDP2's stream)
        exposed_s += intra_dc_s
        shard = self._shard(snapshot_as, feedback=False) if snapshot_as is not None else None
        if self.lookahead and late:
            self._look_ahead(lr, current)
        decision = self._decide(exposed_s) if deciding else None
        if decision is not None and not decision.lookahead and late and snapshot_as is not None:
            shard = self._shard(snapshot_as, feedback=False)  # the lost trial just committed its sum in flight
        for p in self.params:
            p.param.grad = None
        return StepStats(grad_norm=norm, inter_dc_bytes=self.comm.take_bytes(), sync_wait_s=exposed_s,
                         comm_s=intra_dc_s + comm_s, exposed_s=exposed_s, intra_dc_comm_s=intra_dc_s, shard=shard,
                         late=late, lookahead_decision=decision)  # fmt: skip

    def _land(self, sync: _Sync) -> None:
        """Wait for ``sync``'s inter-DC sums and make them the optimizer's gradients."""
        for unit in self.units:
            reduced = sync.reduced[unit.index]
            for x, flight in zip(unit.exchanges, sync.flights.get(unit.index, []), strict=False):
                x.finish(flight, reduced)
        for p, t in zip(self.params, self.tensors, strict=True):
            # A view of the sum (FSDP2's own gradient, for an exact step): nothing reuses the buffer after this.
            g = p.in_reduced(sync.reduced[p.unit])
            if self.grad_scale != 1.0:
                g.mul_(self.grad_scale)
            t.grad = g

    def _commit(self, lr: float, *, write_params: bool = True) -> torch.Tensor:
        """Clip and update the optimizer's tensors with their gradients; returns the norm before clipping.
        ``write_params``: with the look-ahead, copy the committed rows into the parameters (else the look-ahead
        writes them next)."""
        by_param = {id(p): t for p, t in zip(self.params, self.tensors, strict=True)}
        norm = self.norms.norm(lambda p: by_param[id(p)].grad)
        if self.optim_cfg.grad_clip > 0:
            coef = self.clip_coef = torch.clamp(self.optim_cfg.grad_clip / (norm + 1e-6), max=1.0)
            for t in self.tensors:
                t.grad.mul_(coef.to(t.grad.device))
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.steps += 1
        for t in self.tensors:
            t.grad = None
        if self.lookahead and write_params:
            with torch.no_grad():
                for p, t in zip(self.params, self.tensors, strict=True):
                    p.local.copy_(t)
        return norm.detach()

    def _look_ahead(self, lr: float, sync: _Sync) -> None:
        """Parameters <- AdamW(committed, this DC's summed rows × scale), clipped by the last committed coefficient
        (before any: by their own norm), moments untouched."""
        local = {id(p): p.in_reduced(sync.local[u.index]) for u in self.units for p in u.params}
        coef = torch.ones((), device=self.params[0].local.device)
        if self.optim_cfg.grad_clip > 0:
            if self.clip_coef is not None:
                coef = self.clip_coef
            else:
                norm = self.norms.norm(lambda p: local[id(p)]) * self._scale
                coef = torch.clamp(self.optim_cfg.grad_clip / (norm + 1e-6), max=1.0)
        cfg = self.optim_cfg
        by_decay: dict[float, list[int]] = {}
        for i, t in enumerate(self.tensors):
            by_decay.setdefault(self._decay[id(t)], []).append(i)
        for decay, idx in by_decay.items():
            lookahead_adamw(
                [self.tensors[i] for i in idx],
                torch._foreach_mul([local[id(self.params[i])].float() for i in idx], coef * self._scale),
                [self.optimizer.state.get(self.tensors[i]) for i in idx],
                [self.params[i].local for i in idx],
                lr=lr, weight_decay=decay, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, step=self.steps + 1,
            )  # fmt: skip

    def _decide(self, exposed_s: float) -> LookaheadDecision | None:
        """Armed look-ahead, after each step until decided: every rank decides the same (one small all-reduce at
        each check). A trial that lost commits the sum in flight, and the next step is exact again."""
        assert self.chooser is not None
        decision = self.chooser.after_step(self.steps, exposed_s, self.groups.world, self.params[0].local.device)
        if decision is not None and not decision.lookahead:
            if self._in_flight is not None:
                self._commit_in_flight()
            self._drop_committed_copies()
        return decision

    def _drop_committed_copies(self) -> None:
        """A lost trial: the job syncs exactly from here, so the optimizer steps the shards' own rows again (equal
        to the committed ones now) and the copies go."""
        for i, (p, t) in enumerate(zip(self.params, self.tensors, strict=True)):
            if t is p.local:
                continue
            state = self.optimizer.state.pop(t, None)
            if state is not None:
                self.optimizer.state[p.local] = state
            for group in self.optimizer.param_groups:
                group["params"] = [p.local if q is t else q for q in group["params"]]
            self._decay[id(p.local)] = self._decay.pop(id(t))
            self.tensors[i] = p.local
        self.lookahead = False

    @property
    def lookahead_copies(self) -> int:
        """The look-ahead's committed copies of this rank's rows that the engine holds (none once a trial lost)."""
        return sum(t is not p.local for p, t in zip(self.params, self.tensors, strict=True))

    def _commit_in_flight(self) -> None:
        """Look-ahead: land the sum in flight and commit it; the parameters become the committed ones."""
        sync, self._in_flight = self._in_flight, None
        assert sync is not None
        self._land(sync)
        self._commit(self._in_flight_lr)

    def synchronize(self) -> None:
        if self.chooser is not None:
            self.chooser.skip_next()  # a validation pass or the job's end is not a step's time
        if self.lookahead and self._in_flight is not None:
            self._commit_in_flight()

    # -- state -------------------------------------------------------------------------------------------

    def owned_ranges(self) -> list[tuple[str, int, int]]:
        return [(p.name, a, b) for p in self.params for a, b in p.ranges]

    def local_shard(self, step: int) -> LocalShard:
        """Copies of this rank's rows (the committed ones, with the look-ahead) and their moments; the
        error-feedback residuals unless a sum is in flight (it is changing them)."""
        return self._shard(step, feedback=self._in_flight is None)

    def _shard(self, step: int, *, feedback: bool) -> LocalShard:
        """What :meth:`local_shard` copies; a step's snapshot leaves the residuals out (:attr:`feedback_held`)."""
        pieces_ = tuple(piece for p, t in zip(self.params, self.tensors, strict=True)
                        for piece in _pieces(p, t, self.optimizer.state.get(t)))  # fmt: skip
        return LocalShard(step, self.steps, pieces_, feedback=self._feedback() if feedback else ())

    def load_weights(self, model: nn.Module, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for p, t in zip(self.params, self.tensors, strict=True):
                rows = p.take(params[p.name])
                p.local.copy_(rows)
                if t is not p.local:
                    t.copy_(rows)

    def load_local_shard(self, shard: LocalShard) -> None:
        self.steps = shard.adam_step
        self.optimizer.state.clear()
        self.clip_coef = None
        for p, t in zip(self.params, self.tensors, strict=True):
            if not p.ranges or not self.steps:
                continue
            saved = [cut(shard.pieces, p.name, a, b) for a, b in p.ranges]
            if not all(piece.moments for piece in saved):
                raise ValueError(f"the state of step {shard.step} has no AdamW moments for {p.name!r}")
            self.optimizer.state[t] = {
                "step": step_counter(self.optimizer, self.steps, t),
                **{m: torch.cat([piece.moments[m].reshape(-1) for piece in saved]).to(device=t.device, dtype=t.dtype)
                   .reshape(t.shape) for m in MOMENTS},
            }  # fmt: skip
        self._load_feedback(shard.feedback)

    def optimizer_state(self) -> dict[str, Any]:
        """The whole state, gathered inside the DC (every rank of the DC must call it); with the look-ahead's
        committed copies, their values as ``master`` (the parameters are the look-ahead's). With tensor/pipeline
        parallelism: of this rank's stage, its tensor-parallel slices (the other slices' elements zero)."""
        masters = self.lookahead_copies > 0
        mine = {p.name: (p.ranges, {m: host_copy(st[m]) for m in MOMENTS} if st else {},
                         host_copy(t) if masters else None)
                for p, t in zip(self.params, self.tensors, strict=True)
                if (st := self.optimizer.state.get(t)) or masters}  # fmt: skip
        gathered: list[Any] = [mine]
        if self.groups.dc_size > 1:
            gathered = [None] * self.groups.dc_size
            dist.all_gather_object(gathered, mine, group=self.groups.intra_dc)
        shapes = {p.name: p.param.shape for p in self.params}
        params: dict[str, dict[str, torch.Tensor]] = {}
        master: dict[str, torch.Tensor] = {}
        for part in gathered:
            for name, (ranges, moments, value) in part.items():
                numel = math.prod(shapes[name])
                full = params.setdefault(name, {m: torch.zeros(numel) for m in MOMENTS}) if moments else None
                whole = master.setdefault(name, torch.zeros(numel)) if value is not None else None
                at = 0
                for a, b in ranges:
                    if full is not None:
                        for m in MOMENTS:
                            full[m][a:b] = moments[m][at : at + b - a]
                    if whole is not None:
                        whole[a:b] = value.reshape(-1)[at : at + b - a]
                    at += b - a
        state: dict[str, Any] = {"format": FULL_STATE_FORMAT, "step": self.steps,
                                 "params": {n: {m: t.view(shapes[n]) for m, t in ms.items()} for n, ms in params.items()}}
        if master:
            state["master"] = {n: t.view(shapes[n]) for n, t in master.items()}
        return state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Take a whole state (every rank passes the same); its ``master`` values, if any, are the weights."""
        check_full_state(state, [p.name for p in self.params])
        if state.get("master"):
            self.load_weights(self.model, state["master"])
        whole = tuple(StatePiece(n, 0, ms[MOMENTS[0]].numel(), torch.empty(0), {m: ms[m].reshape(-1) for m in MOMENTS})
                      for n, ms in state["params"].items())  # fmt: skip
        self.load_local_shard(LocalShard(0, int(state["step"]), whole, feedback=feedback_of_full_state(state)))

    def exchange_buffer_nbytes(self) -> int:
        """Bytes the inter-DC exchanges hold between steps: the receives posted ahead for the next step's sums."""
        return self.comm.posted_nbytes

    def optimizer_state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))  # fmt: skip

    # Compressed sync's error-feedback residuals, by parameter element (what a durable checkpoint keeps).

    @property
    def feedback_held(self) -> bool:
        return self.comm.compression is not Compression.NONE and self.groups.num_dcs > 1

    def _chunks(self):
        """``(exchange, chunk index, its parts)`` of every chunk step 2 sends, parts as ``(parameter, first
        element, elements)``."""
        elems = max(1, int(self.chunk_bytes) // 4)  # gradients are fp32
        for unit in self.units:
            for x in unit.exchanges:
                for c, parts in enumerate(x.chunk_parts(unit.params, elems)):
                    yield x, c, parts

    def _feedback(self) -> tuple[FeedbackShard, ...]:
        if not self.feedback_held:
            return ()
        out = []
        for x, c, parts in self._chunks():
            residual = self.comm.residual(x.segment, (x.segment.lo, c))
            at = 0
            for p, start, n in parts:
                value = residual[at : at + n] if residual is not None else torch.zeros(n)
                out.append(StatePiece(p.name, start, start + n, host_copy(value)))
                at += n
        return (FeedbackShard(self.groups.dc, self.comm.compression.value, tuple(out)),)

    def _load_feedback(self, held: tuple[FeedbackShard, ...]) -> None:
        self.comm.clear_residuals()
        mine = next((f for f in held if f.dc == self.groups.dc and f.compression == self.comm.compression.value), None)
        if mine is None or not self.feedback_held:
            return
        device = self.params[0].local.device
        for x, c, parts in self._chunks():
            values = []
            for p, start, n in parts:
                try:
                    values.append(cut(mine.pieces, p.name, start, start + n).value.reshape(-1))
                except ValueError:  # a layout or datacenter the saved state does not cover: zero
                    values.append(torch.zeros(n))
            self.comm.set_residual(x.segment, (x.segment.lo, c), torch.cat(values).to(device))

    def close(self) -> None:
        """Wait for every sum still in flight (none may outlive the engine's groups) and drop it."""
        for sync in (self._in_flight, self._current):
            if sync is None:
                continue
            for flights in sync.flights.values():
                for flight in flights:
                    for h in flight.handles:
                        h.wait()
        self._in_flight, self._current = None, _Sync()
        for unit in self.units:  # the model outlives the engine in cycles: it must not hold the engine (its groups)
            unit.module.set_all_reduce_hook(_no_hook)


def _no_hook(reduced: torch.Tensor) -> None:
    """The all-reduce hook of a closed engine's units: nothing more to sum."""


def _pieces(p: ShardParam, t: torch.Tensor, state: dict[str, Any] | None) -> list[StatePiece]:
    """Host copies of what this rank holds of ``p`` (``t``: its values, the optimizer's tensor, with ``state``'s
    moments): one piece per range of the whole parameter it covers (:attr:`ShardParam.ranges`), each a view of one
    copy of the local rows."""
    if not p.ranges:
        return []
    if len(p.ranges) == 1:
        (a, b), = p.ranges
        return [piece_of(p.name, a, b, t, state)]
    whole = piece_of(p.name, 0, t.numel(), t, state)
    out, at = [], 0
    for a, b in p.ranges:
        out.append(StatePiece(p.name, a, b, whole.value[at : at + b - a],
                              {m: v[at : at + b - a] for m, v in whole.moments.items()}))
        at += b - a
    return out
