"""Which rows of a parameter each rank holds under FSDP2's dim-0 sharding, and which ranks of the other
datacenters hold the same rows: the pieces the inter-datacenter sum exchanges.

``fully_shard`` cuts dim 0 of a parameter of ``n0`` rows into chunks of ``c = ceil(n0 / n)`` rows for the ``n``
ranks of its mesh: rank ``k`` holds rows ``[k·c, min((k + 1)·c, n0))`` (the last ranks fewer, or none), and its
reduce-scatter output holds ``c`` rows per parameter, the missing ones padding. Every datacenter shards over its
own ranks, so with datacenters of different sizes (3 + 1 after a node loss) a rank's rows are held by several
ranks of another datacenter. Cutting dim 0 at every datacenter's chunk boundaries gives *pieces*, each held by
exactly one rank in every datacenter; those owners sum it across datacenters. With equal sizes the pieces are
the chunks and the owners are the ranks of the same index in each datacenter.

Pure arithmetic: no torch.distributed, so the cuts are tested on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def chunk_rows(n0: int, n: int) -> int:
    """Rows per rank when ``n`` ranks shard ``n0`` rows (FSDP2's padded chunk)."""
    return -(-n0 // n) if n0 else 0


def rows_of(n0: int, n: int, k: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` that rank ``k`` of ``n`` holds of a parameter with ``n0`` rows (``lo == hi``: none)."""
    c = chunk_rows(n0, n)
    lo = min(k * c, n0)
    return lo, min(lo + c, n0)


@dataclass(frozen=True)
class RowPiece:
    """Rows ``[lo, hi)`` of one parameter and the datacenter-local index of the rank holding them in each
    datacenter (in the order of the sizes given)."""

    lo: int
    hi: int
    holders: tuple[int, ...]


def pieces(n0: int, sizes: Sequence[int]) -> list[RowPiece]:
    """Dim 0 of a parameter of ``n0`` rows cut at every datacenter's chunk boundaries, for datacenters of
    ``sizes`` ranks: consecutive pieces covering ``[0, n0)``."""
    chunks = [chunk_rows(n0, n) for n in sizes]
    cuts = sorted({min(k * c, n0) for c, n in zip(chunks, sizes, strict=True) for k in range(n + 1)} | {0, n0})
    return [RowPiece(lo, hi, tuple(lo // c for c in chunks)) for lo, hi in zip(cuts, cuts[1:], strict=False) if hi > lo]
