"""Rank arithmetic of datacenter layouts, and a sample order that survives a resize."""

from __future__ import annotations

import pytest

from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.text import TextDataset, rank_slice
from meridian.workers.distributed.layout import DCLayout


@pytest.mark.parametrize("dcs", [("a", "a", "b", "b"), ("a", "a", "b"), ("a", "a", "a", "b", "b"),
                                 ("a", "b", "a", "b"), ("a",), ("a", "b", "c", "c")])
def test_every_unit_has_exactly_one_owner_per_datacenter(dcs):
    layout = DCLayout(dcs)
    covered = {dc: [0] * layout.units for dc in layout.dcs}
    for rank in range(layout.world_size):
        lo, hi = layout.shard_units(rank)
        for u in range(lo, hi):
            covered[layout.dc_of(rank)][u] += 1
    assert all(c == [1] * layout.units for c in covered.values())
    # segments tile the bucket, and each segment's owner in each DC really owns it
    assert [s.lo for s in layout.segments][0] == 0 and layout.segments[-1].hi == layout.units
    for seg in layout.segments:
        for dc, owner in zip(layout.dcs, seg.owners, strict=True):
            lo, hi = layout.shard_units(owner)
            assert layout.dc_of(owner) == dc and lo <= seg.lo and seg.hi <= hi


def test_uneven_layout_segments():
    layout = DCLayout(("a", "a", "a", "b", "b"))
    assert layout.units == 6
    assert [(s.lo, s.hi, s.owners) for s in layout.segments] == [
        (0, 2, (0, 3)), (2, 3, (1, 3)), (3, 4, (1, 4)), (4, 6, (2, 4))]
    assert layout.dc_rank(4) == 1 and layout.dc_size(4) == 2


def test_layout_rejects_nameless_ranks():
    with pytest.raises(ValueError, match="datacenter name"):
        DCLayout(("a", ""))


@pytest.mark.parametrize("batch, size", [(16, 4), (16, 3), (7, 7), (5, 2)])
def test_rank_slices_partition_the_global_batch(batch, size):
    slices = [rank_slice(batch, r, size) for r in range(size)]
    assert [s.start for s in slices] == [0] + [s.stop for s in slices[:-1]] and slices[-1].stop == batch
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_a_step_sees_the_same_samples_whatever_the_number_of_ranks():
    data = TextDataset(DataConfig(), seq_len=32, seed=3)
    for step in (0, 5, 10_000):  # 10_000 crosses epochs
        reference = data.sample_ids(step * 12, 12)
        for ranks in (1, 2, 3, 4, 5):
            ids = []
            for r in range(ranks):
                s = rank_slice(12, r, ranks)
                ids += data.sample_ids(step * 12 + s.start, len(s))
            assert ids == reference
    assert len(set(data.sample_ids(0, data.num_samples))) == data.num_samples  # an epoch is a permutation


def test_batches_are_next_token_pairs_of_real_text():
    data = TextDataset(DataConfig(), seq_len=16, seed=0)
    x, y = data.batch(0, 3)
    assert x.shape == y.shape == (3, 16) and (x[:, 1:] == y[:, :-1]).all()
    sample, _ = data.batch(0, 8)
    text = bytes(sample.flatten().tolist()).decode("utf-8", errors="replace")
    # English prose, not noise: letters and spaces are most of 128 bytes (~22% of random bytes). One 16-byte
    # sample alone can be mostly code or punctuation: under Python 3.12's bundled text the first held 8 of 16.
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.6 * len(text)


def test_unreadable_source_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot be read on this node"):
        TextDataset(DataConfig(source=str(tmp_path / "missing.txt")), seq_len=8, seed=0)
    with pytest.raises(ValueError, match="absolute path"):
        TextDataset(DataConfig(source="relative.txt"), seq_len=8, seed=0)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hi")
    with pytest.raises(ValueError, match="too few for one train sample"):
        TextDataset(DataConfig(source=str(tiny)), seq_len=8, seed=0)
