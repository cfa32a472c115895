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
    step(lr)         wait for 2); clip (the norm of the local shards, summed in the DC) and AdamW, both on this
                     rank's shard only
                     # 3) all-gather inside the DC         FSDP2, at the next forward: the updated parameters

Only step 2 crosses the slow link, carrying this rank's rows (1/N of the model for N ranks in its DC), once.
Parameters, gradients and optimizer state live sharded inside a DC and replicated across DCs: a whole replica of
the state in every datacenter, which is what recovery rebuilds from (:mod:`meridian.workers.state.replica_state`).
Datacenters of any sizes: the pieces and their holders come from :mod:`meridian.workers.distributed.shard_rows`.
With ``overlap`` off, step 2 starts in ``step`` instead of during backward (what overlap saves is measured by
running both).

The optimizer is torch's AdamW over the plain local tensors of the shards (fused on CUDA), so its state is
exactly this rank's rows: ``(parameter, start, stop)`` element ranges of each flattened parameter, the form
snapshots, the survivors' exchange and durable checkpoints already speak.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from meridian.workers.contracts.config import Compression, OptimConfig, SyncConfig
from meridian.workers.distributed.layout import DCGroups, Segment
from meridian.workers.distributed.shard_rows import chunk_rows, pieces, rows_of
from meridian.workers.optim.adamw import (
    FULL_STATE_FORMAT,
    MOMENTS,
    check_full_state,
    make_adamw,
    param_groups,
    set_lr,
    step_counter,
)
from meridian.workers.parallel.fsdp import apply_fsdp, dc_mesh
from meridian.workers.state.replica_state import (
    FeedbackShard,
    LocalShard,
    StatePiece,
    cut,
    host_copy,
    piece_of,
)
from meridian.workers.sync.engine import GradientSync, StepStats, broadcast_parameters
from meridian.workers.sync.har import chunk_views
from meridian.workers.sync.inter_dc import CommHandle, InterDCComm
from meridian.workers.wan.emulator import WanEmulator


@dataclass
class _Param:
    """One parameter of an FSDP unit, as this rank holds it."""

    name: str
    param: nn.Parameter
    """The sharded parameter (a DTensor)."""
    local: torch.Tensor
    """Its local rows, a plain tensor (what the optimizer updates in place)."""
    rows: tuple[int, int]
    """Rows ``[lo, hi)`` of dim 0 this rank holds."""
    row_numel: int
    offset: int
    """First element of this parameter's padded rows in the unit's reduce-scatter output."""

    @property
    def start(self) -> int:
        return self.rows[0] * self.row_numel

    @property
    def stop(self) -> int:
        return self.rows[1] * self.row_numel


@dataclass
class _Exchange:
    """What this rank sums with one tuple of holders, one per datacenter, for one unit."""

    segment: Segment
    """Its holders (``owners``, world ranks in datacenter order); ``lo``/``hi``: the unit, naming it."""
    group: dist.ProcessGroup
    spans: list[tuple[int, int]]
    """Element ranges ``[a, b)`` of the unit's reduce-scatter output, in parameter order, merged where adjacent."""
    buf: torch.Tensor | None = None
    handles: list[CommHandle] = field(default_factory=list)

    def start(self, reduced: torch.Tensor, comm: InterDCComm, chunk_bytes: float, unit: int) -> None:
        if len(self.spans) == 1:  # one range: summed where it lies, no copy
            a, b = self.spans[0]
            self.buf = reduced[a:b]
        else:
            self.buf = torch.cat([reduced[a:b] for a, b in self.spans])
        self.handles = [comm.all_reduce_async(chunk, self.group, self.segment, key=(unit, c))
                        for c, chunk in enumerate(chunk_views(self.buf, chunk_bytes))]  # fmt: skip

    def finish(self, reduced: torch.Tensor) -> None:
        for h in self.handles:
            h.wait()
        self.handles = []
        assert self.buf is not None
        if len(self.spans) > 1:
            at = 0
            for a, b in self.spans:
                reduced[a:b].copy_(self.buf[at : at + b - a])
                at += b - a
        self.buf = None


@dataclass
class _Unit:
    index: int
    module: FSDPModule
    params: list[_Param]
    exchanges: list[_Exchange] = field(default_factory=list)
    reduced: torch.Tensor | None = None
    """The last reduce-scatter output, until ``step`` has landed it in the gradients."""


def _fsdp_params(unit: FSDPModule) -> list[Any]:
    """The FSDP params of ``unit`` in reduce-scatter order (torch keeps them on the unit's param group; there is no
    public accessor)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    return [] if group is None else list(group.fsdp_params)


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
    ) -> None:
        if sync.delay_one_step or sync.local_lookahead:
            raise ValueError("delay_one_step and local_lookahead run on the flat-bucket engine, not on FSDP2")
        self.groups, self.optim_cfg = groups, optim
        self.grad_scale = grad_scale
        self.overlap = sync.overlap
        self.chunk_bytes = sync.inter_dc_chunk_mb * 2**20
        device = next(model.parameters()).device
        if broadcast_params:  # every replica starts from the same weights (whole, before sharding)
            broadcast_parameters(model, src=groups.world_ranks[0], group=groups.world)
        self.mesh = dc_mesh(groups.intra_dc, device)
        fsdp_units = apply_fsdp(model, self.mesh, reshard_after_forward=reshard_after_forward)
        self.model = model
        self.root = fsdp_units[-1]
        self.comm = InterDCComm(sync.compression, emulator=emulator)
        self.units = self._describe(model, fsdp_units)
        if groups.num_dcs > 1:
            self._plan_exchanges()
        for unit in self.units:
            unit.module.set_all_reduce_hook(lambda reduced, unit=unit: self._reduced(unit, reduced))
        named = [(p.name, p.local) for u in self.units for p in u.params]
        self.params = [p for u in self.units for p in u.params]
        self.optimizer = make_adamw(param_groups(named, model, optim), optim)
        self.steps = 0
        """Optimizer steps taken (AdamW's bias-correction count)."""
        self._started_at: float | None = None

    # -- layout ------------------------------------------------------------------------------------------

    def _describe(self, model: nn.Module, fsdp_units: list[FSDPModule]) -> list[_Unit]:
        names = {id(p): n for n, p in model.named_parameters()}
        n, k = self.groups.dc_size, self.groups.dc_rank
        units = []
        for i, module in enumerate(fsdp_units):
            params, offset = [], 0
            for fp in _fsdp_params(module):
                size = fp._orig_size
                n0, row_numel = (size[0], math.prod(size[1:])) if len(size) else (1, 1)
                param = fp.sharded_param
                local = param.data.to_local()
                rows = rows_of(n0, n, k)
                if local.numel() != (rows[1] - rows[0]) * row_numel:
                    raise AssertionError(f"{names[id(param)]}: FSDP holds {local.numel()} elements here, "
                                         f"rows {rows} of {tuple(size)} would be {(rows[1] - rows[0]) * row_numel}")
                params.append(_Param(names[id(param)], param, local, rows, row_numel, offset))
                offset += chunk_rows(n0, n) * row_numel
            if params:
                units.append(_Unit(i, module, params))
        return units

    def _plan_exchanges(self) -> None:
        """For every unit, the pieces of this rank's rows and who holds each in the other DCs; the groups of every
        holder tuple of the model (every rank creates all of them, in the same order)."""
        layout = self.groups.layout
        sizes = [len(layout.ranks_in(dc)) for dc in layout.dcs]
        me = layout.dcs.index(self.groups.dc)
        holders_of = [[layout.ranks_in(dc)[i] for i in range(s)] for dc, s in zip(layout.dcs, sizes, strict=True)]
        mine: dict[int, dict[tuple[int, ...], list[tuple[int, int]]]] = {}
        every: set[tuple[int, ...]] = set()
        for unit in self.units:
            for p in unit.params:
                n0 = p.param.shape[0] if p.param.dim() else 1
                for piece in pieces(n0, sizes):
                    owners = tuple(holders_of[d][h] for d, h in enumerate(piece.holders))
                    every.add(owners)
                    if piece.holders[me] != self.groups.dc_rank:
                        continue
                    a = p.offset + (piece.lo - p.rows[0]) * p.row_numel
                    spans = mine.setdefault(unit.index, {}).setdefault(owners, [])
                    b = a + (piece.hi - piece.lo) * p.row_numel
                    if spans and spans[-1][1] == a:
                        spans[-1] = (spans[-1][0], b)
                    else:
                        spans.append((a, b))
        groups = self.groups.owner_groups(sorted(every))
        me_world = self.groups.rank
        for unit in self.units:
            for owners, spans in sorted(mine.get(unit.index, {}).items()):
                assert me_world in owners
                unit.exchanges.append(_Exchange(Segment(unit.index, unit.index, owners), groups[owners], spans))

    # -- one step ----------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        # Earlier micro-batches accumulate unsharded gradients; the last reduce-scatters them (and, through the
        # hook, starts the inter-DC sum).
        self.root.set_requires_gradient_sync(last_micro_batch)
        loss.backward()

    def _reduced(self, unit: _Unit, reduced: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: ``reduced`` holds this rank's DC-summed rows of the unit (padded)."""
        unit.reduced = reduced
        if self.overlap:
            self._start(unit)

    def _start(self, unit: _Unit) -> None:
        assert unit.reduced is not None
        if self._started_at is None:
            self._started_at = time.perf_counter()
        for x in unit.exchanges:
            x.start(unit.reduced, self.comm, self.chunk_bytes, unit.index)

    def step(self, lr: float, *, snapshot_as: int | None = None) -> StepStats:
        t0 = time.perf_counter()
        for unit in self.units:
            if not self.overlap:
                self._start(unit)
        started = self._started_at if self._started_at is not None else t0
        for unit in self.units:
            self._land(unit)
        done = time.perf_counter()
        exposed_s, comm_s = done - t0, (done - started) if self.groups.num_dcs > 1 else 0.0
        self._started_at = None
        norm = self._clip()
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.steps += 1
        for p in self.params:
            p.local.grad = None
            p.param.grad = None
        shard = self.local_shard(snapshot_as) if snapshot_as is not None else None
        return StepStats(grad_norm=norm, inter_dc_bytes=self.comm.take_bytes(), sync_wait_s=exposed_s, comm_s=comm_s,
                         exposed_s=exposed_s, shard=shard)  # fmt: skip

    def _land(self, unit: _Unit) -> None:
        """Wait for the unit's inter-DC sums and make them the optimizer's gradients (local tensors)."""
        reduced, unit.reduced = unit.reduced, None
        if reduced is None:
            raise RuntimeError("step() before the last micro-batch's backward: no gradients were reduced")
        for x in unit.exchanges:
            x.finish(reduced)
        for p in unit.params:
            g = p.param.grad.to_local() if p.param.grad is not None else None
            src = reduced[p.offset : p.offset + p.local.numel()].view_as(p.local)
            if g is None or g.data_ptr() != src.data_ptr():  # FSDP made a copy (or none): take the summed rows
                g = src.clone() if g is None else g.copy_(src)
            if self.grad_scale != 1.0:
                g.mul_(self.grad_scale)
            p.local.grad = g

    def _clip(self) -> torch.Tensor:
        """Clip the global gradient norm; returns it before clipping. After step 2 every DC holds the whole
        gradient, so the sum of squares over this DC's shards is the global one."""
        device = self.params[0].local.device
        sumsq = torch.zeros((), dtype=torch.float64, device=device)
        for p in self.params:
            sumsq += p.local.grad.double().square().sum()
        if self.groups.dc_size > 1:
            dist.all_reduce(sumsq, group=self.groups.intra_dc)
        norm = sumsq.sqrt().float()
        if self.optim_cfg.grad_clip > 0:
            coef = torch.clamp(self.optim_cfg.grad_clip / (norm + 1e-6), max=1.0)
            for p in self.params:
                p.local.grad.mul_(coef)
        return norm

    # -- state -------------------------------------------------------------------------------------------

    def owned_ranges(self) -> list[tuple[str, int, int]]:
        return [(p.name, p.start, p.stop) for p in self.params if p.stop > p.start]

    def local_shard(self, step: int) -> LocalShard:
        pieces_ = tuple(piece_of(p.name, p.start, p.stop, p.local, self.optimizer.state.get(p.local))
                        for p in self.params if p.stop > p.start)  # fmt: skip
        return LocalShard(step, self.steps, pieces_, feedback=self._feedback())

    def load_weights(self, model: nn.Module, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for p in self.params:
                full = params[p.name].reshape(-1)
                p.local.copy_(full[p.start : p.stop].view_as(p.local))

    def load_local_shard(self, shard: LocalShard) -> None:
        self.steps = shard.adam_step
        self.optimizer.state.clear()
        for p in self.params:
            if p.stop == p.start or not self.steps:
                continue
            saved = cut(shard.pieces, p.name, p.start, p.stop)
            if not saved.moments:
                raise ValueError(f"the state of step {shard.step} has no AdamW moments for {p.name!r}")
            self.optimizer.state[p.local] = {
                "step": step_counter(self.optimizer, self.steps, p.local),
                **{m: saved.moments[m].to(device=p.local.device, dtype=p.local.dtype).reshape(p.local.shape).clone()
                   for m in MOMENTS},
            }  # fmt: skip
        self._load_feedback(shard.feedback)

    def optimizer_state(self) -> dict[str, Any]:
        """The whole state, gathered inside the DC (every rank of the DC must call it)."""
        mine = {p.name: (p.start, {m: host_copy(st[m]) for m in MOMENTS})
                for p in self.params if (st := self.optimizer.state.get(p.local))}  # fmt: skip
        gathered: list[Any] = [None] * self.groups.dc_size
        if self.groups.dc_size > 1:
            dist.all_gather_object(gathered, mine, group=self.groups.intra_dc)
        else:
            gathered = [mine]
        shapes = {p.name: p.param.shape for p in self.params}
        params: dict[str, dict[str, torch.Tensor]] = {}
        for part in gathered:
            for name, (start, moments) in part.items():
                full = params.setdefault(name, {m: torch.zeros(math.prod(shapes[name])) for m in MOMENTS})
                for m in MOMENTS:
                    full[m][start : start + moments[m].numel()] = moments[m]
        params = {n: {m: t.view(shapes[n]) for m, t in ms.items()} for n, ms in params.items()}
        return {"format": FULL_STATE_FORMAT, "step": self.steps, "params": params}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        check_full_state(state, [p.name for p in self.params])
        full = [StatePiece(n, 0, ms[MOMENTS[0]].numel(), torch.empty(0), {m: ms[m].reshape(-1) for m in MOMENTS})
                for n, ms in state["params"].items()]  # fmt: skip
        self.load_local_shard(LocalShard(0, int(state["step"]), tuple(full)))

    def optimizer_state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))  # fmt: skip

    # Compressed sync's error-feedback residuals, by parameter element (what a durable checkpoint keeps).

    @property
    def feedback_held(self) -> bool:
        return self.comm.compression is not Compression.NONE and self.groups.num_dcs > 1

    def _feedback_spans(self):
        """``(unit, exchange, chunk index, [(param, element range in it, range in the chunk)])`` of every chunk."""
        for unit in self.units:
            by_offset = sorted(unit.params, key=lambda p: p.offset)
            for x in unit.exchanges:
                spans = [(a, b) for a, b in x.spans]
                flat: list[tuple[_Param, int, int]] = []  # (param, first element in it, elements)
                for a, b in spans:
                    for p in by_offset:
                        lo, hi = max(a, p.offset), min(b, p.offset + p.local.numel())
                        if lo < hi:
                            flat.append((p, p.start + lo - p.offset, hi - lo))
                total = sum(n for _, _, n in flat)
                step = total if self.chunk_bytes is None else max(1, int(self.chunk_bytes) // 4)
                for c, at in enumerate(range(0, total, step)):
                    yield unit, x, c, _window(flat, at, min(total, at + step))

    def _feedback(self) -> tuple[FeedbackShard, ...]:
        if not self.feedback_held:
            return ()
        out = []
        for unit, x, c, parts in self._feedback_spans():
            residual = self.comm.residual(x.segment, (unit.index, c))
            at = 0
            for p, start, n, _ in parts:
                value = residual[at : at + n] if residual is not None else torch.zeros(n)
                out.append(StatePiece(p.name, start, start + n, host_copy(value)))
                at += n
        return (FeedbackShard(self.groups.dc, self.comm.compression.value, tuple(out)),)

    def _load_feedback(self, held: tuple[FeedbackShard, ...]) -> None:
        self.comm.clear_residuals()
        mine = next((f for f in held if f.dc == self.groups.dc and f.compression == self.comm.compression.value), None)
        if mine is None or not self.feedback_held:
            return
        for unit, x, c, parts in self._feedback_spans():
            values = []
            for p, start, n, _ in parts:
                try:
                    values.append(cut(mine.pieces, p.name, start, start + n).value)
                except ValueError:
                    values.append(torch.zeros(n))
            device = self.params[0].local.device
            self.comm.set_residual(x.segment, (unit.index, c), torch.cat(values).to(device))

    def close(self) -> None:
        for unit in self.units:
            for x in unit.exchanges:
                for h in x.handles:
                    h.wait()
                x.handles = []


def _window(flat: list[tuple[Any, int, int]], lo: int, hi: int) -> list[tuple[Any, int, int, int]]:
    """The parts of the concatenation of ``flat`` (``(param, first element, elements)``) in ``[lo, hi)``, as
    ``(param, first element, elements, offset in the window)``."""
    out, at = [], 0
    for p, start, n in flat:
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((p, start + a - at, b - a, a - lo))
        at += n
    return out
