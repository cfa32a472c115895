"""An ended job leaves nothing of its own in ``/dev/shm``: a cancelled job's training processes are killed, so the
emulated WAN's shared link files, which only a process that ends on its own removes, stayed in RAM (reproduced:
``examples/demo.json`` with ``"wan"``, cancelled mid-training through ``meridian serve``: 8 ``meridian-wan-job-<id>``
files were still there after the job was ``cancelled``). The sweep every end of a job runs on each host
(:func:`meridian.workers.state.snapshot_paths.remove_snapshot_dirs`) removes them with the snapshot folders."""

from __future__ import annotations

import os
import secrets
from types import SimpleNamespace

from meridian.workers.loop.replica import Replica
from meridian.workers.state.snapshot_paths import _snapshot_root, remove_snapshot_dirs, snapshot_dir
from meridian.workers.wan.link import FILE_PREFIX, safe_name


def _wan_files(job_id: str, epoch: int) -> list[str]:
    """The files the WAN emulator of ``job_id``'s ``epoch`` writes: the key as ``Replica.key_prefix`` and
    ``link.agree_key`` make it."""
    prefix = Replica.key_prefix.fget(SimpleNamespace(cfg=SimpleNamespace(job_id=job_id), m=SimpleNamespace(epoch=epoch)))
    key = f"{safe_name(prefix)[:48]}.{secrets.token_hex(4)}"
    return [os.path.join(_snapshot_root(), f"{FILE_PREFIX}{key}+{what}")
            for what in ("link+dc-a+dc-b", "link+dc-b+dc-a", "ledger+g3-675cacecc628", "ledger+g3-675cacecc628_0_ffda")]


def _touch(paths: list[str]) -> None:
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"\0" * 24)


def test_sweep_removes_the_jobs_wan_link_files_of_every_epoch_and_no_others() -> None:
    job_id = secrets.token_hex(6)  # as the service makes them
    others = [secrets.token_hex(6), job_id + "0", job_id[:-1]]  # another job, and ids sharing a prefix with it
    mine = _wan_files(job_id, 0) + _wan_files(job_id, 1) + _wan_files(job_id, 12)
    theirs = [path for other in others for path in _wan_files(other, 0) + _wan_files(other, 3)]
    os.makedirs(snapshot_dir(job_id, "w1"))
    _touch(mine + theirs)
    try:
        removed = remove_snapshot_dirs(job_id)
        left = [path for path in mine if os.path.exists(path)]
        assert not left, f"the ended job's WAN link files stayed in RAM: {left}"
        assert all(os.path.exists(path) for path in theirs), "another job's WAN link files were removed"
        assert not os.path.exists(snapshot_dir(job_id, "w1"))
        assert sorted(removed) == sorted([snapshot_dir(job_id, "w1"), *mine])
    finally:
        for path in mine + theirs:
            if os.path.exists(path):
                os.unlink(path)
