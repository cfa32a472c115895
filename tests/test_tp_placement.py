"""Which elements of a whole parameter a rank holds under tensor parallelism and FSDP2, as element ranges of the
flattened parameter (:mod:`meridian.workers.parallel.placement`): checked against torch's own chunking, without
torch.distributed, and tiling every parameter exactly once over the ranks."""

from __future__ import annotations

import pytest
import torch

from meridian.workers.distributed.shard_rows import rows_of
from meridian.workers.parallel.placement import TPPlacement, full_ranges


def _tp_local(full: torch.Tensor, tp: TPPlacement) -> torch.Tensor:
    """The rank's tensor-parallel piece as DTensor lays it out (``Shard``: ``torch.chunk``; ``_StridedShard``: that
    rank's chunk of each part, side by side)."""
    if tp.tp == 1:
        return full
    parts = full.chunk(tp.parts, dim=tp.dim)
    pieces = [p.chunk(tp.tp, dim=tp.dim) for p in parts]
    held = [p[tp.rank] for p in pieces if tp.rank < len(p)]  # torch.chunk leaves the last ranks none, or fewer
    return torch.cat(held, dim=tp.dim) if held else full.narrow(tp.dim, 0, 0)


CASES = [
    ((12, 4), 0, 1),  # column-parallel weight (output features)
    ((12,), 0, 1),  # its bias
    ((12, 4), 0, 3),  # fused q/k/v weight: each rank its chunk of q, of k and of v
    ((12,), 0, 3),
    ((4, 12), 1, 1),  # row-parallel weight: a column slice, one range per row
    ((5, 6, 4), 1, 1),  # a later dimension of a 3-D parameter
    ((7, 5), 0, 1),  # uneven chunks: the last rank holds fewer
    ((6, 4), 0, 1),
]


@pytest.mark.parametrize("shape, dim, parts", CASES)
@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_ranges_hold_exactly_the_local_rows_and_tile_the_parameter_once(shape, dim, parts, tp, dp):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    covered = torch.zeros(full.numel(), dtype=torch.int64)
    for t in range(tp):
        placement = TPPlacement(dim=dim, tp=tp, rank=t, parts=parts) if tp > 1 else TPPlacement()
        local = _tp_local(full, placement)
        assert placement.local_shape(shape) == tuple(local.shape)
        for k in range(dp):
            rows = rows_of(local.shape[0], dp, k)  # FSDP2's rows of the piece
            ranges = full_ranges(shape, placement, rows)
            held = local[rows[0] : rows[1]].reshape(-1)
            flat = full.reshape(-1)
            got = torch.cat([flat[a:b] for a, b in ranges]) if ranges else flat[:0]
            assert torch.equal(got, held), (t, k, ranges)
            assert all(b0 < a1 for (_, b0), (a1, _) in zip(ranges, ranges[1:], strict=False))  # ordered, merged
            for a, b in ranges:
                covered[a:b] += 1
    assert bool((covered == 1).all())  # every element held by exactly one (TP rank, FSDP rank)


def test_a_column_slice_is_one_range_per_row_and_a_row_block_one_range():
    assert full_ranges((4, 12), TPPlacement(dim=1, tp=2, rank=1), (1, 3)) == ((18, 24), (30, 36))
    assert full_ranges((12, 4), TPPlacement(dim=0, tp=2, rank=1), (0, 6)) == ((24, 48),)
    # fused q/k/v, tp 2, rank 1 holds rows 2-3 of q, 6-7 of k, 10-11 of v; FSDP rows 1..5 of those six
    assert full_ranges((12, 1), TPPlacement(dim=0, tp=2, rank=1, parts=3), (1, 5)) == ((3, 4), (6, 8), (10, 11))
    assert full_ranges((8, 2), TPPlacement(), (2, 2)) == ()
