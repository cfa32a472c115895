"""Error-feedback residuals in and out of a rank's saved state, so a resume carries the rounding error on.

A compressed inter-DC sync (:mod:`meridian.workers.sync.inter_dc`) keeps, per chunk it sends, what the encoding
lost, and adds it to that chunk's next value. Dropped on a resume, the run changes (int8 hierarchical sync,
nano: step-8 loss 4.417744 uninterrupted, 4.418003 resumed without them). They are held by chunk of a segment
of a bucket, which only this layout knows, so they are saved by parameter element instead
(:class:`~meridian.workers.state.replica_state.FeedbackShard`: the rank's shard of each bucket cut along the
parameters, as the optimizer state is), each datacenter's apart: per element, what that datacenter's
contribution to the sum has not yet sent.

A resume puts back its own datacenter's residuals of the elements its shard holds, cut into its chunks: with
the layout unchanged, exactly the state the run had. From a durable checkpoint of another layout a datacenter's
ranks take what it owed per element into their new chunks; a datacenter, encoding or element the saved state
lacks starts at zero. In-memory snapshots carry them only where the engine's snapshots hold them (DiLoCo's outer
deltas, :func:`~meridian.workers.state.replica_state.pack`); a re-formation from the hierarchical engine's snapshots
restarts them at zero. This module never communicates.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from meridian.workers.distributed.layout import DCGroups, Segment
from meridian.workers.state.replica_state import FeedbackShard, StatePiece, cut, host_copy
from meridian.workers.sync.grad_buffer import Bucket
from meridian.workers.sync.har import chunks_across_dcs, shard_range
from meridian.workers.sync.inter_dc import InterDCComm


def _chunks(buf: torch.Tensor, groups: DCGroups, chunk_bytes: float | None):
    """``(segment, chunk index, first element in this rank's shard, elements)`` of every chunk step 2 sends."""
    lo, _ = shard_range(buf, groups)
    for seg, _, c, chunk in chunks_across_dcs(buf, groups, chunk_bytes):
        yield seg, c, chunk.storage_offset() - buf.storage_offset() - lo, chunk.numel()


def feedback_shard(
    comm: InterDCComm, buckets: list[Bucket], bufs: list[torch.Tensor], groups: DCGroups, chunk_bytes: float | None,
    *, settled: Mapping[tuple[Segment, Hashable], torch.Tensor | None] | None = None,
) -> tuple[FeedbackShard, ...]:
    """This rank's residuals as host copies by parameter element (zeros for a chunk not yet sent); ``()``
    without compression. ``bufs[b]``: the tensor step 2 runs on for bucket ``b`` (its dtype sets the chunks).
    ``settled[(segment, (b, c))]``: the residual to save instead of the one the comm holds (an engine's chunk whose
    sync is in flight: what it held before that sync's encoding; ``None``: zero)."""
    if comm.feedback_encoding is None or not groups.inter_dc:
        return ()
    settled = settled or {}
    pieces = []
    for b, (bucket, buf) in enumerate(zip(buckets, bufs, strict=True)):
        lo, hi = shard_range(buf, groups)
        shard = torch.zeros(hi - lo, dtype=torch.float32, device=buf.device)
        for seg, c, at, n in _chunks(buf, groups, chunk_bytes):
            key = (seg, (b, c))
            residual = settled[key] if key in settled else comm.residual(seg, (b, c))
            if residual is not None:
                shard[at : at + n] = residual
        for s in bucket.slots:
            start, stop = max(lo, s.offset), min(hi, s.stop)
            if start < stop:
                pieces.append(StatePiece(s.name, start - s.offset, stop - s.offset, host_copy(shard[start - lo : stop - lo])))
    return (FeedbackShard(groups.dc, comm.feedback_encoding, tuple(pieces)),)


def load_feedback(
    comm: InterDCComm, buckets: list[Bucket], bufs: list[torch.Tensor], groups: DCGroups, chunk_bytes: float | None,
    held: tuple[FeedbackShard, ...],
) -> None:
    """Replace this rank's residuals with its datacenter's in ``held`` (saved ones, any layout's), cut into
    this layout's chunks; everything ``held`` lacks restarts at zero."""
    comm.clear_residuals()
    mine = next((f for f in held if f.dc == groups.dc and f.compression == comm.feedback_encoding), None)
    if mine is None or comm.feedback_encoding is None:
        return
    for b, (bucket, buf) in enumerate(zip(buckets, bufs, strict=True)):
        lo, hi = shard_range(buf, groups)
        shard = torch.zeros(hi - lo, dtype=torch.float32, device=buf.device)
        for s in bucket.slots:
            start, stop = max(lo, s.offset), min(hi, s.stop)
            if start < stop:
                try:
                    piece = cut(mine.pieces, s.name, start - s.offset, stop - s.offset)
                except ValueError:
                    continue  # not saved: zero
                shard[start - lo : stop - lo] = piece.value
        for seg, c, at, n in _chunks(buf, groups, chunk_bytes):
            comm.set_residual(seg, (b, c), shard[at : at + n].clone())
