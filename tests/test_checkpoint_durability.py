"""A committed checkpoint outlives a power loss: every file it is made of, and every name that makes it the
newest (the folder's rename, ``latest``), reaches the disk before the next name points at it.

A test cannot cut the power, so it records the order of what the save asks of the kernel (``fsync`` of which
file or folder, ``rename`` of what) and checks that nothing is named before what it names is on the disk."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from meridian.workers.state import checkpoint as ckpt_io
from meridian.workers.state import sharded_checkpoint, storage


def _record(monkeypatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        real_replace(src, dst)
        calls.append(("rename", str(dst)))

    monkeypatch.setattr(storage.os, "fsync", fsync)
    monkeypatch.setattr(storage.os, "replace", replace)
    return calls


def _index(calls: list[tuple[str, str]], call: tuple[str, str], after: int = -1) -> int:
    return next(i for i, c in enumerate(calls) if c == call and i > after)


def test_a_saved_checkpoint_is_on_the_disk_before_latest_names_it(tmp_path, monkeypatch) -> None:
    calls = _record(monkeypatch)
    root = (tmp_path / "job").resolve()
    ckpt_io.save(str(root), ckpt_io.Checkpoint(step=7, model={"w": torch.ones(3)}, optimizer={}, fingerprint={}))
    final, partial = root / "step-00000007", root / ".step-00000007.partial"

    state = _index(calls, ("fsync", str(partial / "state.pt")))  # the weights, in the folder being written
    entries = _index(calls, ("fsync", str(partial)), after=state)  # and the folder's entry for them
    renamed = _index(calls, ("rename", str(final)), after=entries)  # only then is the folder named complete
    root_synced = _index(calls, ("fsync", str(root)), after=renamed)  # that rename on the disk
    latest_tmp = next(i for i, (op, path) in enumerate(calls)
                      if op == "fsync" and Path(path).name.startswith(".latest.") and i > root_synced)
    latest = _index(calls, ("rename", str(root / "latest")), after=latest_tmp)  # `latest` written whole, then named
    _index(calls, ("fsync", str(root)), after=latest)  # and its name on the disk
    assert ckpt_io.load_latest(str(root)).step == 7  # type: ignore[union-attr]


def test_every_small_file_is_synced_before_it_replaces_the_old_one(tmp_path, monkeypatch) -> None:
    calls = _record(monkeypatch)
    target = tmp_path.resolve() / "meridian.json"
    storage.write_text(str(target), "{}")
    synced = next(i for i, (op, path) in enumerate(calls) if op == "fsync" and path.endswith(".tmp"))
    renamed = _index(calls, ("rename", str(target)), after=synced)
    _index(calls, ("fsync", str(tmp_path.resolve())), after=renamed)
    assert target.read_text() == "{}"


def test_the_sharded_format_s_data_files_are_synced_by_the_checkpoint_writer(tmp_path) -> None:
    # Each rank's shard goes through torch.distributed.checkpoint's writer, which syncs its files when told to;
    # the folder, meridian.json and `latest` then take the path above.
    assert sharded_checkpoint._writer(str(tmp_path)).sync_files is True
