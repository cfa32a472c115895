"""What one rank holds of each FSDP2 unit, and how it sums those rows with their holders in the other datacenters.

An FSDP2 unit's reduce-scatter output is one flat tensor: for every parameter, in the unit's order, this rank's
``c = ceil(rows / N)`` rows (the missing ones padding), N the ranks of its datacenter. Cut along every
datacenter's chunk boundaries (:mod:`meridian.workers.distributed.shard_rows`), each piece of those rows has one
holder per datacenter; the holders of a piece sum it. A rank's pieces with the same holders, across the unit's
parameters, travel as one buffer (a view where they are one range, else packed), in chunks, through
:class:`~meridian.workers.sync.inter_dc.InterDCComm`.

The same pieces give the gradient norm every datacenter computes bit for bit alike (:class:`NormPlan`): one
entry per piece of the model, summed over the datacenter's ranks (one contributor each), then added in one order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from meridian.workers.distributed.layout import DCGroups, Segment
from meridian.workers.distributed.shard_rows import chunk_rows, pieces, rows_of
from meridian.workers.parallel.placement import TPPlacement, full_ranges, placement_of
from meridian.workers.sync.inter_dc import CommHandle, InterDCComm


def chunk_views(view: torch.Tensor, chunk_bytes: float | None) -> list[torch.Tensor]:
    """``view`` cut in consecutive pieces of at most ``chunk_bytes`` (at least one element each)."""
    if chunk_bytes is None or view.numel() == 0:
        return [view]
    step = max(1, int(chunk_bytes) // view.element_size())
    return list(view.split(step))


@dataclass
class ShardParam:
    """One parameter of an FSDP unit, as this rank holds it."""

    name: str
    unit: int
    """The index of its FSDP unit."""
    param: nn.Parameter
    """The sharded parameter (a DTensor)."""
    local: torch.Tensor
    """Its local rows, a plain tensor sharing the parameter's storage (what the optimizer updates in place)."""
    rows: tuple[int, int]
    """Rows ``[lo, hi)`` of dim 0 this rank holds."""
    n0: int
    """Rows of the whole parameter."""
    row_numel: int
    offset: int
    """First element of this parameter's (padded) rows in the unit's reduce-scatter output."""
    tp: TPPlacement = field(default_factory=TPPlacement)
    """How tensor parallelism cuts the whole parameter (``rows``, ``n0`` and ``row_numel`` are of this rank's
    tensor-parallel piece, which FSDP2 shards; without tensor parallelism the piece is the whole parameter)."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Element ranges of the flattened whole parameter that :attr:`local` holds, in its order
    (:func:`~meridian.workers.parallel.placement.full_ranges`): one range, or (a row-parallel weight's column
    slice) one per row."""

    def full_parts(self, lo: int, n: int) -> list[tuple[int, int]]:
        """``(first element of the whole parameter, elements)`` of :attr:`local`'s elements ``[lo, lo + n)``."""
        out, at = [], 0
        for a, b in self.ranges:
            x, y = max(lo, at), min(lo + n, at + b - a)
            if x < y:
                out.append((a + x - at, y - x))
            at += b - a
        return out

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's elements of the whole parameter ``whole``, shaped like :attr:`local`."""
        flat = whole.reshape(-1)
        return torch.cat([flat[a:b] for a, b in self.ranges]).view_as(self.local) if self.ranges else \
            flat[:0].view_as(self.local)  # fmt: skip

    def in_reduced(self, reduced: torch.Tensor) -> torch.Tensor:
        """This parameter's rows in a reduce-scatter output of its unit, shaped like :attr:`local`."""
        return reduced[self.offset : self.offset + self.local.numel()].view_as(self.local)


@dataclass
class Flight:
    """One exchange's sum, in flight."""

    buf: torch.Tensor
    handles: list[CommHandle]


@dataclass
class Exchange:
    """What this rank sums with one tuple of holders (one per datacenter) for one unit."""

    segment: Segment
    """Its holders (``owners``: layout ranks in datacenter order); ``lo``/``hi``: the unit's index."""
    group: dist.ProcessGroup
    spans: list[tuple[int, int]]
    """Element ranges ``[a, b)`` of the unit's reduce-scatter output, in parameter order, merged where adjacent."""

    def start(self, reduced: torch.Tensor, comm: InterDCComm, chunk_bytes: float | None) -> Flight:
        """Start summing these ranges of ``reduced`` (a view where they are one range, else a packed copy)."""
        if len(self.spans) == 1:
            a, b = self.spans[0]
            buf = reduced[a:b]
        else:
            buf = torch.cat([reduced[a:b] for a, b in self.spans])
        unit = self.segment.lo
        handles = [comm.all_reduce_async(chunk, self.group, self.segment, key=(unit, c))
                   for c, chunk in enumerate(chunk_views(buf, chunk_bytes))]  # fmt: skip
        return Flight(buf, handles)

    def finish(self, flight: Flight, reduced: torch.Tensor) -> None:
        """Wait for ``flight`` and leave the sums in their ranges of ``reduced``."""
        for h in flight.handles:
            h.wait()
        flight.handles = []
        if len(self.spans) > 1:
            at = 0
            for a, b in self.spans:
                reduced[a:b].copy_(flight.buf[at : at + b - a])
                at += b - a

    def chunk_parts(self, params: list[ShardParam], chunk_elems: int) -> list[list[tuple[ShardParam, int, int]]]:
        """Per chunk :meth:`start` sends: ``(parameter, first element of it, elements)`` in the chunk's order."""
        flat: list[tuple[ShardParam, int, int]] = []
        for a, b in self.spans:
            for p in params:
                lo, hi = max(a, p.offset), min(b, p.offset + p.local.numel())
                if lo < hi:
                    flat += [(p, start, n) for start, n in p.full_parts(lo - p.offset, hi - lo)]
        total = sum(n for _, _, n in flat)
        out = []
        for at in range(0, total, max(1, chunk_elems)):
            out.append(_window(flat, at, min(total, at + chunk_elems)))
        return out


@dataclass
class Unit:
    """One FSDP unit as this rank holds it."""

    index: int
    module: FSDPModule
    params: list[ShardParam]
    exchanges: list[Exchange] = field(default_factory=list)


def _fsdp_params(unit: FSDPModule) -> list[Any]:
    """The FSDP params of ``unit`` in reduce-scatter order (torch keeps them on the unit's param group; there is no
    public accessor)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    return [] if group is None else list(group.fsdp_params)


def describe_units(model: nn.Module, fsdp_units: list[FSDPModule], groups: DCGroups) -> list[Unit]:
    """What this rank holds of each unit (units without parameters left out), checked against FSDP2's shards."""
    names = {id(p): n for n, p in model.named_parameters()}
    n, k = groups.dc_size, groups.dc_rank
    units = []
    for i, module in enumerate(fsdp_units):
        params, offset = [], 0
        for fp in _fsdp_params(module):
            if not fp.sharded_param.requires_grad:  # frozen: never reduced, never stepped
                continue
            size = fp._orig_size
            n0, row_numel = (size[0], math.prod(size[1:])) if len(size) else (1, 1)
            param = fp.sharded_param
            local = param.data.to_local()
            rows = rows_of(n0, n, k)
            if local.numel() != (rows[1] - rows[0]) * row_numel:
                raise AssertionError(f"{names[id(param)]}: FSDP holds {local.numel()} elements here, rows {rows} of "
                                     f"{tuple(size)} would be {(rows[1] - rows[0]) * row_numel}")
            tp = placement_of(param)  # (size is this rank's tensor-parallel piece; param.shape the whole's)
            ranges = full_ranges(param.shape, tp, rows)
            params.append(ShardParam(names[id(param)], i, param, local, rows, n0, row_numel, offset, tp, ranges))
            offset += chunk_rows(n0, n) * row_numel
        if params:
            units.append(Unit(i, module, params))
    return units


def _dc_sizes(groups: DCGroups) -> tuple[list[int], int, list[list[int]]]:
    layout = groups.layout
    sizes = [len(layout.ranks_in(dc)) for dc in layout.dcs]
    holders = [list(layout.ranks_in(dc)) for dc in layout.dcs]
    return sizes, layout.dcs.index(groups.dc), holders


def plan_exchanges(units: list[Unit], groups: DCGroups) -> None:
    """Fill every unit's :attr:`Unit.exchanges`: the pieces of this rank's rows by their holder tuples, and the
    groups of every holder tuple of the model (every rank makes all of them, in the same order)."""
    sizes, me, holders_of = _dc_sizes(groups)
    mine: dict[int, dict[tuple[int, ...], list[tuple[int, int]]]] = {}
    every: set[tuple[int, ...]] = set()
    for unit in units if groups.num_dcs > 1 else ():  # one datacenter: nothing to sum (a sibling's groups only)
        for p in unit.params:
            for piece in pieces(p.n0, sizes):
                owners = tuple(holders_of[d][h] for d, h in enumerate(piece.holders))
                every.add(owners)
                if piece.holders[me] != groups.dc_rank:
                    continue
                a = p.offset + (piece.lo - p.rows[0]) * p.row_numel
                b = a + (piece.hi - piece.lo) * p.row_numel
                spans = mine.setdefault(unit.index, {}).setdefault(owners, [])
                if spans and spans[-1][1] == a:
                    spans[-1] = (spans[-1][0], b)
                else:
                    spans.append((a, b))
    made = groups.owner_groups(sorted(every))
    for unit in units:
        for owners, spans in sorted(mine.get(unit.index, {}).items()):
            unit.exchanges.append(Exchange(Segment(unit.index, unit.index, owners), made[owners], spans))


class NormPlan:
    """The global gradient norm, the same bits in every datacenter: one entry per piece of every parameter
    (the pieces every datacenter's chunks cut), each filled by its holder in this datacenter, summed inside the
    datacenter (one contributor per entry: exact) and added up in entry order."""

    def __init__(self, units: list[Unit], groups: DCGroups) -> None:
        sizes, me, _ = _dc_sizes(groups)
        self.groups = groups
        self.entries: list[tuple[int, ShardParam, int, int]] = []
        """``(entry index, parameter, first local element, last)`` of the entries this rank fills."""
        mp = groups.mp_norm
        count = 0
        for unit in units:
            for p in unit.params:
                # a tensor-parallel job: a parameter every TP rank holds whole counts on TP rank 0 only
                counted = mp is None or p.tp.tp > 1 or mp.tp_rank == 0
                for piece in pieces(p.n0, sizes):
                    if counted and piece.holders[me] == groups.dc_rank:
                        lo = (piece.lo - p.rows[0]) * p.row_numel
                        self.entries.append((count, p, lo, lo + (piece.hi - piece.lo) * p.row_numel))
                    count += 1
        self.size = count

    def norm(self, grad_of) -> torch.Tensor:
        """The norm of the gradient whose local rows of parameter ``p`` are ``grad_of(p)``."""
        device = self.entries[0][1].local.device if self.entries else torch.device("cpu")
        sumsq = torch.zeros(self.size, dtype=torch.float64, device=device)
        for i, p, lo, hi in self.entries:
            sumsq[i] = grad_of(p).reshape(-1)[lo:hi].double().square().sum()
        if self.groups.dc_size > 1:
            dist.all_reduce(sumsq, group=self.groups.intra_dc)
        total = sumsq.sum()
        if self.groups.mp_norm is not None:  # the other stages' and tensor-parallel ranks' parts of the replica
            total = self.groups.mp_norm.total(total)
        return total.sqrt().float()


def _window(flat: list[tuple[ShardParam, int, int]], lo: int, hi: int) -> list[tuple[ShardParam, int, int]]:
    """The parts of the concatenation of ``flat`` (``(param, first element, elements)``) in ``[lo, hi)``."""
    out, at = [], 0
    for p, start, n in flat:
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((p, start + a - at, b - a))
        at += n
    return out
