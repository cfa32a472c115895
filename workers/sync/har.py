"""Hierarchical all-reduce (HAR) of one flat, padded buffer (any dtype the backend sums: fp32, bf16, fp16).

    # 1) reduce-scatter inside the DC      each rank ends with the DC-sum of its shard (1/N of the buffer)
    # 2) all-reduce the shard across DCs   owners of the same segment, one per DC, sum it, chunk by chunk
    # 3) all-gather inside the DC          every rank has the global sum again

Only step 2 crosses the slow link, and it carries 1/N of the buffer per rank (N = ranks in the DC). Step 2
goes through :class:`meridian.workers.sync.inter_dc.InterDCComm` (compression, byte counting, WAN emulation)
in chunks of ``chunk_bytes``, all issued asynchronously so they are in flight together. The result equals
a flat all-reduce (SUM) up to floating-point summation order. Works for any datacenter sizes: segments and
their owners come from :class:`meridian.workers.distributed.layout.DCLayout`, and every rank issues its step-2
collectives in global segment order, so uneven layouts cannot deadlock.

The training engines do not call it: on FSDP2 (:mod:`meridian.workers.sync.fsdp_har`) steps 1 and 3 are FSDP2's,
and step 2 is :mod:`meridian.workers.sync.shard_exchange` (which takes :func:`chunk_views` from here).

Steps 1 and 3 on a CPU rank are direct point-to-point transfers (:mod:`meridian.workers.distributed.direct_collectives`):
gloo's reduce-scatter alone cost more than an all-reduce of the whole buffer. On CUDA they are NCCL's collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meridian.workers.distributed import direct_collectives as direct
from meridian.workers.distributed.flat_collectives import all_gather_single, reduce_scatter_single
from meridian.workers.distributed.layout import DCGroups, Segment
from meridian.workers.sync.inter_dc import CommHandle, InterDCComm


def unit_size(buf: torch.Tensor, groups: DCGroups) -> int:
    units = groups.layout.units
    if buf.numel() % units:
        raise ValueError(f"buffer of {buf.numel()} elements is not padded to a multiple of {units} units")
    return buf.numel() // units


def shard_range(buf: torch.Tensor, groups: DCGroups) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of ``buf`` that this rank owns inside its datacenter."""
    u = unit_size(buf, groups)
    lo, hi = groups.layout.shard_units(groups.rank)
    return lo * u, hi * u


def shard_view(buf: torch.Tensor, groups: DCGroups) -> torch.Tensor:
    """This rank's shard of ``buf`` inside its datacenter."""
    lo, hi = shard_range(buf, groups)
    return buf[lo:hi]


def segment_view(buf: torch.Tensor, groups: DCGroups, seg: Segment) -> torch.Tensor:
    u = unit_size(buf, groups)
    return buf[seg.lo * u : seg.hi * u]


def chunk_views(view: torch.Tensor, chunk_bytes: float | None) -> list[torch.Tensor]:
    """``view`` cut in consecutive pieces of at most ``chunk_bytes`` (at least one element each)."""
    if chunk_bytes is None or view.numel() == 0:
        return [view]
    step = max(1, int(chunk_bytes) // view.element_size())
    return list(view.split(step))


def reduce_scatter_in_dc(buf: torch.Tensor, groups: DCGroups, *, into: torch.Tensor | None = None) -> torch.Tensor:
    """Step 1: leave the DC-sum of this rank's shard in its place in ``buf`` (or, with ``into``, a buffer of
    the same layout, ``buf`` left as it was); return that shard view."""
    shard = shard_view(buf if into is None else into, groups)
    if groups.dc_size == 1:
        if into is not None:
            shard.copy_(buf)  # the whole buffer is this rank's shard
    elif direct.serves(buf):  # CPU: direct transfers, half gloo's collective's cost (direct_collectives)
        direct.reduce_scatter(shard, buf, groups.intra_dc)  # into ``buf``'s own shard too: it only adds there
    elif into is not None:  # a separate output: the collective writes it directly
        reduce_scatter_single(shard, buf, op=dist.ReduceOp.SUM, group=groups.intra_dc)
    else:
        out = torch.empty_like(shard)  # the output may not alias the input
        reduce_scatter_single(out, buf, op=dist.ReduceOp.SUM, group=groups.intra_dc)
        shard.copy_(out)
    return shard


def chunks_across_dcs(buf: torch.Tensor, groups: DCGroups, chunk_bytes: float | None):
    """``(segment, its inter-DC group, chunk index, chunk view)`` of every chunk of every segment this rank owns,
    in global segment order: what step 2 sends, in the order every owner issues it."""
    for seg, group in groups.inter_dc.items():  # dict order is global segment order
        for c, chunk in enumerate(chunk_views(segment_view(buf, groups, seg), chunk_bytes)):
            yield seg, group, c, chunk


def start_all_reduce_across_dcs(
    buf: torch.Tensor, groups: DCGroups, comm: InterDCComm, *, chunk_bytes: float | None = None, bucket: int = 0
) -> list[CommHandle]:
    """Step 2, issued: every chunk of every segment this rank owns, in global segment order, in flight."""
    return [comm.all_reduce_async(chunk, group, seg, key=(bucket, c))
            for seg, group, c, chunk in chunks_across_dcs(buf, groups, chunk_bytes)]  # fmt: skip


def post_receives_across_dcs(
    buf: torch.Tensor, groups: DCGroups, comm: InterDCComm, *, chunk_bytes: float | None = None, bucket: int = 0
) -> None:
    """Post the receive of every chunk's first step-2 exchange ahead (:meth:`InterDCComm.post_receive`), with the
    same chunks and names :func:`start_all_reduce_across_dcs` will use for ``buf``."""
    for seg, group, c, chunk in chunks_across_dcs(buf, groups, chunk_bytes):
        comm.post_receive(chunk, group, seg, key=(bucket, c))


def all_reduce_across_dcs(
    buf: torch.Tensor,
    groups: DCGroups,
    comm: InterDCComm,
    *,
    chunk_bytes: float | None = None,
    bucket: int = 0,
) -> int:
    """Step 2: sum each segment this rank owns with its owners in the other DCs. Returns bytes sent."""
    handles = start_all_reduce_across_dcs(buf, groups, comm, chunk_bytes=chunk_bytes, bucket=bucket)
    for h in handles:
        h.wait()
    return round(sum(h.nbytes for h in handles))


def all_gather_in_dc(
    buf: torch.Tensor, groups: DCGroups, *, async_op: bool = False
) -> dist.Work | direct.Transfers | None:
    """Step 3: every rank of the DC receives every shard (of gradients, or of updated parameters)."""
    if groups.dc_size == 1:
        return None
    if direct.serves(buf):  # CPU: direct transfers, no copy of the shard (direct_collectives)
        return direct.all_gather(buf, groups.intra_dc, async_op=async_op)
    shard = shard_view(buf, groups).clone()  # the input may not alias the output
    return all_gather_single(buf, shard, group=groups.intra_dc, async_op=async_op)


def hierarchical_all_reduce(
    buf: torch.Tensor,
    groups: DCGroups,
    comm: InterDCComm | None = None,
    *,
    chunk_bytes: float | None = None,
    bucket: int = 0,
) -> int:
    """In-place SUM all-reduce of ``buf`` over every rank; returns the bytes this rank sent across DCs."""
    comm = comm or InterDCComm()
    reduce_scatter_in_dc(buf, groups)  # 1) reduce-scatter inside the DC
    sent = all_reduce_across_dcs(buf, groups, comm, chunk_bytes=chunk_bytes, bucket=bucket)  # 2) across DCs
    all_gather_in_dc(buf, groups)  # 3) all-gather inside the DC
    return sent
