"""Hierarchical all-reduce (HAR) of one flat, padded buffer.

    # 1) reduce-scatter inside the DC      each rank ends with the DC-sum of its shard (1/N of the buffer)
    # 2) all-reduce the shard across DCs   owners of the same segment, one per DC, sum it
    # 3) all-gather inside the DC          every rank has the global sum again

Only step 2 crosses the slow link, and it carries 1/N of the buffer per rank (N = ranks in the DC).
The result equals a flat all-reduce (SUM) up to floating-point summation order. Works for any datacenter
sizes: segments and their owners come from :class:`meridian.workers.layout.DCLayout`. Every rank runs its
step-2 collectives in global segment order, so uneven layouts cannot deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meridian.workers.layout import DCGroups, Segment


def unit_size(buf: torch.Tensor, groups: DCGroups) -> int:
    units = groups.layout.units
    if buf.numel() % units:
        raise ValueError(f"buffer of {buf.numel()} elements is not padded to a multiple of {units} units")
    return buf.numel() // units


def shard_view(buf: torch.Tensor, groups: DCGroups) -> torch.Tensor:
    """This rank's shard of ``buf`` inside its datacenter."""
    u = unit_size(buf, groups)
    lo, hi = groups.layout.shard_units(groups.rank)
    return buf[lo * u : hi * u]


def segment_view(buf: torch.Tensor, groups: DCGroups, seg: Segment) -> torch.Tensor:
    u = unit_size(buf, groups)
    return buf[seg.lo * u : seg.hi * u]


def reduce_scatter_in_dc(buf: torch.Tensor, groups: DCGroups) -> torch.Tensor:
    """Step 1: leave the DC-sum of this rank's shard in its place in ``buf``; return that shard view."""
    shard = shard_view(buf, groups)
    if groups.dc_size > 1:
        out = torch.empty_like(shard)
        dist.reduce_scatter_single(out, buf, op=dist.ReduceOp.SUM, group=groups.intra_dc)
        shard.copy_(out)
    return shard


def all_reduce_across_dcs(buf: torch.Tensor, groups: DCGroups) -> int:
    """Step 2: sum each segment this rank owns with its owners in the other DCs. Returns bytes sent."""
    sent = 0
    for seg, group in groups.inter_dc.items():  # dict order is global segment order
        view = segment_view(buf, groups, seg)
        dist.all_reduce(view, op=dist.ReduceOp.SUM, group=group)
        sent += view.numel() * view.element_size()
    return sent


def all_gather_in_dc(buf: torch.Tensor, groups: DCGroups) -> None:
    """Step 3: every rank of the DC receives every shard."""
    if groups.dc_size > 1:
        shard = shard_view(buf, groups).clone()
        dist.all_gather_single(buf, shard, group=groups.intra_dc)


def hierarchical_all_reduce(buf: torch.Tensor, groups: DCGroups) -> int:
    """In-place SUM all-reduce of ``buf`` over every rank; returns the bytes this rank sent across DCs."""
    reduce_scatter_in_dc(buf, groups)  # 1) reduce-scatter inside the DC
    sent = all_reduce_across_dcs(buf, groups)  # 2) all-reduce the shard across DCs
    all_gather_in_dc(buf, groups)  # 3) all-gather inside the DC
    return sent
