"""Snapshot files hold a shard packed (a description and one flat tensor), and give back the shard that was kept."""

from __future__ import annotations

import pytest
import torch

from meridian.workers.state.replica_state import LocalShard, OuterShard, StatePiece, pack
from meridian.workers.state.snapshots import SnapshotStore, read_packed


def shard(step: int) -> LocalShard:
    moments = {"exp_avg": torch.full((3,), 0.5 * step), "exp_avg_sq": torch.full((3,), 0.25 * step)}
    pieces = (StatePiece("w", 2, 5, torch.arange(3.0) + step, moments), StatePiece("b", 0, 1, torch.ones(1)))
    return LocalShard(step, step + 1, pieces, OuterShard("dc-b", 4, (StatePiece("w", 2, 5, torch.zeros(3)),)))


def same(a: LocalShard, b: LocalShard) -> bool:
    def pieces(x):
        return [(p.name, p.start, p.stop, p.value.tolist(), {k: v.tolist() for k, v in p.moments.items()})
                for p in x]  # fmt: skip

    return ((a.step, a.adam_step, pieces(a.pieces)) == (b.step, b.adam_step, pieces(b.pieces))
            and (a.outer is None) == (b.outer is None)
            and (a.outer is None or (a.outer.dc, a.outer.inner_steps_done, pieces(a.outer.pieces))
                 == (b.outer.dc, b.outer.inner_steps_done, pieces(b.outer.pieces))))  # fmt: skip


def test_the_next_process_reads_back_the_shards_kept(tmp_path):
    store = SnapshotStore(2, str(tmp_path))
    for step in (1, 2, 3):
        store.append(shard(step))
    after = SnapshotStore(2, str(tmp_path))  # the next training process's store of the same folder
    assert after.last_step == 3 and after.get(1) is None  # the newest two are kept
    assert same(after.get(3), shard(3)) and same(after.get(2), shard(2))
    path = tmp_path / "shard-0000000003.pt"
    desc, flat = read_packed(path)  # a description and one flat tensor
    assert desc["step"] == 3 and flat.numel() == 3 * 3 + 1 + 3
    # the numbers raw after the magic, the description's length and the description: 4 bytes each, no more
    head = int.from_bytes(path.read_bytes()[4:12], "little")
    assert path.read_bytes()[:4] == b"MRDS" and path.stat().st_size == 12 + head + 4 * flat.numel()
    assert flat[-3:].tolist() == [0.0, 0.0, 0.0] and flat[:3].tolist() == [3.0, 4.0, 5.0]


def test_files_older_versions_wrote_still_read(tmp_path):
    torch.save(shard(7), tmp_path / "shard-0000000007.pt")  # the shard object itself
    torch.save(pack(shard(8)), tmp_path / "shard-0000000008.pt")  # packed, in torch.save's format
    store = SnapshotStore(2, str(tmp_path))
    assert same(store.get(7), shard(7)) and same(store.get(8), shard(8))


def test_a_file_cut_short_is_an_error_not_a_shard_of_zeros(tmp_path):
    SnapshotStore(2, str(tmp_path)).append(shard(3))
    path = tmp_path / "shard-0000000003.pt"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(EOFError, match="fewer numbers"):
        SnapshotStore(2, str(tmp_path)).get(3)


def test_a_read_ahead_is_taken_by_the_read_of_its_step_and_only_by_it(tmp_path):
    store = SnapshotStore(2, str(tmp_path))
    for step in (2, 3):
        store.append(shard(step))
    after = SnapshotStore(2, str(tmp_path))
    after.read_ahead(3)
    after._ahead[1].join()  # read: the file may go now
    (tmp_path / "shard-0000000003.pt").rename(tmp_path / "moved.pt")
    assert same(after.get(3), shard(3))  # from the read ahead, not the file
    assert after.get(3) is None  # taken once: a second read goes to the folder
    after.read_ahead(2)
    assert same(after.get(2), shard(2))
    after.read_ahead(2)  # another step's read ignores it and reads its own file
    (tmp_path / "moved.pt").rename(tmp_path / "shard-0000000003.pt")
    assert same(after.get(3), shard(3)) and after._ahead is None
    after.read_ahead(9)  # no such file: the read finds none, as a plain read would
    assert after.get(9) is None


def test_a_read_ahead_not_taken_is_dropped_once_training_goes_on(tmp_path):
    store = SnapshotStore(2, str(tmp_path))
    store.append(shard(3))
    store.read_ahead(3)
    store.append(shard(4))
    assert store._ahead is None
