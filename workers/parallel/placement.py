"""Which elements of a whole parameter one rank holds under tensor parallelism and FSDP2, as element ranges of the
flattened whole parameter: the vocabulary snapshots, the survivors' exchange and durable checkpoints speak
(:mod:`meridian.workers.state.replica_state`).

A tensor-parallel placement cuts one dimension ``d`` of the parameter across the ``tp`` ranks:

    replicate        every rank holds all of it
    shard d          rank t holds chunk t of dim d (``torch.chunk``'s sizes: ``ceil(n / tp)``, the last ones fewer)
    strided d, sf    dim d is ``sf`` equal parts (a fused q/k/v weight: sf = 3) and rank t holds chunk t of each,
                     one after another (DTensor's ``_StridedShard``)

FSDP2 then keeps rows ``[lo, hi)`` of dim 0 of that tensor-parallel piece (:mod:`meridian.workers.distributed.
shard_rows`). Cut along dim 0 (``d = 0``) the rows held are ranges of whole rows; cut along a later dimension
(a row-parallel weight's input features) every row held contributes a range of its own, one per outer index.

Pure arithmetic (but :func:`placement_of`, which reads a DTensor's placement): no torch.distributed, so the
mapping is tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TPPlacement:
    """How tensor parallelism cuts one parameter: along ``dim`` into ``tp`` chunks of each of ``parts`` equal parts
    (``tp == 1``: replicated, every rank holds all of it)."""

    dim: int = 0
    tp: int = 1
    rank: int = 0
    parts: int = 1

    def segments(self, size: int) -> list[tuple[int, int]]:
        """``(first index, length)`` along ``dim`` (of ``size``) of what this rank holds, in its local order."""
        if self.tp == 1:
            return [(0, size)]
        if size % self.parts:
            raise ValueError(f"dim {self.dim} of size {size} does not split into {self.parts} equal parts")
        part = size // self.parts
        c = -(-part // self.tp)
        out = []
        for j in range(self.parts):
            lo = min(self.rank * c, part)
            n = min(lo + c, part) - lo
            if n:
                out.append((j * part + lo, n))
        return out

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of this rank's tensor-parallel piece of a parameter of ``shape``."""
        if not shape:
            return ()
        n = sum(length for _, length in self.segments(shape[self.dim]))
        return tuple(n if i == self.dim else s for i, s in enumerate(shape))


def full_ranges(shape: Sequence[int], tp: TPPlacement, rows: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Element ranges ``[start, stop)`` of the flattened whole parameter of ``shape`` that rows ``rows`` (of dim 0
    of this rank's tensor-parallel piece) hold, in the piece's row-major order, adjacent ranges merged: the
    concatenation of those ranges of the whole parameter, flattened, is the local rows' elements."""
    shape = tuple(shape) or (1,)
    lo, hi = rows
    if lo >= hi:
        return ()
    inner = math.prod(shape[1:])
    out: list[tuple[int, int]] = []

    def add(a: int, b: int) -> None:
        if a >= b:
            return
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))

    segments = tp.segments(shape[tp.dim])
    if tp.dim == 0:
        at = 0  # local row of each segment's first row
        for first, n in segments:
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                add((first + a - at) * inner, (first + b - at) * inner)
            at += n
        return tuple(out)
    size_d, inner_d = shape[tp.dim], math.prod(shape[tp.dim + 1 :])
    outer_per_row = math.prod(shape[1 : tp.dim])
    for outer in range(lo * outer_per_row, hi * outer_per_row):
        base = outer * size_d * inner_d
        for first, n in segments:
            add(base + first * inner_d, base + (first + n) * inner_d)
    return tuple(out)


def placement_of(param) -> TPPlacement:  # noqa: ANN001 - a DTensor (torch is imported only here)
    """The tensor-parallel placement of a (DTensor) parameter: its placement on the mesh dimension named ``tp``
    (:mod:`meridian.workers.parallel.dims`); replicated when it has none."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = getattr(param, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" not in names:
        return TPPlacement()
    i = names.index("tp")
    placement, tp, rank = param.placements[i], mesh.size(i), mesh.get_local_rank(i)
    if isinstance(placement, _StridedShard):
        return TPPlacement(dim=placement.dim, tp=tp, rank=rank, parts=placement.split_factor)
    if isinstance(placement, Shard):
        return TPPlacement(dim=placement.dim, tp=tp, rank=rank)
    return TPPlacement()
