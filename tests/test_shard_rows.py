"""FSDP2's dim-0 rows per rank, and the pieces datacenters of any sizes sum across: pure arithmetic."""

from __future__ import annotations

import pytest

from meridian.workers.distributed.shard_rows import chunk_rows, pieces, rows_of


@pytest.mark.parametrize("n0, n", [(7, 4), (8, 4), (1, 3), (3, 5), (0, 2), (100, 7)])
def test_ranks_hold_every_row_once_in_fsdp2s_chunks(n0, n):
    held = [rows_of(n0, n, k) for k in range(n)]
    assert [r for lo, hi in held for r in range(lo, hi)] == list(range(n0))
    assert all(hi - lo <= chunk_rows(n0, n) for lo, hi in held)
    # torch.chunk's sizes: ceil(n0 / n) each until the rows run out
    import torch

    sizes = [c.shape[0] for c in torch.arange(n0).chunk(n)] if n0 else []
    assert [hi - lo for lo, hi in held if hi > lo] == sizes


def test_even_datacenters_pieces_are_the_chunks_with_same_index_holders():
    assert [(p.lo, p.hi, p.holders) for p in pieces(8, (2, 2))] == [(0, 4, (0, 0)), (4, 8, (1, 1))]


def test_uneven_datacenters_cut_at_both_boundaries():
    # 10 rows: 3 ranks hold 4, 4, 2; 2 ranks hold 5, 5
    assert [(p.lo, p.hi, p.holders) for p in pieces(10, (3, 2))] == [
        (0, 4, (0, 0)), (4, 5, (1, 0)), (5, 8, (1, 1)), (8, 10, (2, 1))]


@pytest.mark.parametrize("n0, sizes", [(7, (3, 1)), (13, (4, 3, 2)), (2, (3, 3)), (1, (2, 1))])
def test_each_piece_lies_inside_one_rank_of_every_datacenter(n0, sizes):
    out = pieces(n0, sizes)
    assert out[0].lo == 0 and out[-1].hi == n0
    assert all(a.hi == b.lo for a, b in zip(out, out[1:], strict=False))
    for p in out:
        for n, k in zip(sizes, p.holders, strict=True):
            lo, hi = rows_of(n0, n, k)
            assert lo <= p.lo and p.hi <= hi
