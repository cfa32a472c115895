"""A new worker takes over the RAM snapshot folder of a worker of its job whose agent died on the same host."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from meridian.workers.state import snapshot_paths
from meridian.workers.state.snapshot_paths import OWNER_FILE, adopt_orphan, mark_owner, snapshot_dir


@pytest.fixture(autouse=True)
def ram_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_paths, "_snapshot_root", lambda: str(tmp_path))
    return tmp_path


def _folder(job, worker, *, owner: str | None, shards=()):
    """A snapshot folder holding ``shards``, whose owner file (if any) reads ``owner`` ("pid start")."""
    folder = snapshot_dir(job, worker)
    os.makedirs(folder)
    if owner is not None:
        with open(os.path.join(folder, OWNER_FILE), "w") as f:
            f.write(owner)
    for step in shards:
        open(os.path.join(folder, f"shard-{step:010d}.pt"), "w").close()
    return folder


def _this_process() -> str:
    return f"{os.getpid()} {snapshot_paths._process_start(os.getpid())}"


def _a_dead_process() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = snapshot_paths._process_start(proc.pid)
    proc.kill()
    proc.wait()
    return f"{proc.pid} {start}"


def _dead_folder(job, worker, shards):
    return _folder(job, worker, owner=_a_dead_process(), shards=shards)


def test_the_newest_orphan_of_the_job_is_taken_and_owned_by_the_new_worker():
    older = _dead_folder("job", "old-a", shards=(21, 22))
    newer = _dead_folder("job", "old-b", shards=(22, 23))
    live = _folder("job", "alive", owner=_this_process(), shards=(30,))
    unowned = _folder("job", "unowned", owner=None, shards=(40,))
    other_job = _dead_folder("other", "old-c", shards=(50,))

    assert adopt_orphan("job", "new-1") == newer
    mine = snapshot_dir("job", "new-1")
    assert sorted(os.listdir(mine)) == [OWNER_FILE, "shard-0000000022.pt", "shard-0000000023.pt"]
    assert snapshot_paths.owner_alive(mine) is True  # this process owns it now: nobody else takes it
    assert adopt_orphan("job", "new-2") == older  # the next new worker takes the other one
    assert adopt_orphan("job", "new-3") is None  # a live owner's, an unowned and another job's are left alone
    assert os.path.isdir(live) and os.path.isdir(unowned) and os.path.isdir(other_job)
    assert os.listdir(snapshot_dir("job", "new-3")) == [OWNER_FILE]


def test_a_reused_pid_does_not_pass_for_the_dead_owner():
    # this pid, but another start time: the process that wrote it is gone
    folder = _folder("job", "old", owner=f"{os.getpid()} 1", shards=(5,))
    assert adopt_orphan("job", "new") == folder


def _adopt(job, worker, root, out, release):
    snapshot_paths._snapshot_root = lambda: root
    out.put((worker, adopt_orphan(job, worker)))
    release.wait(30)  # an agent lives while it uses its folder: once it exits, the folder is an orphan again


def test_workers_starting_at_once_never_take_the_same_folder(ram_folder):
    orphans = {_dead_folder("job", f"old-{i}", shards=(i + 1,)) for i in range(3)}
    ctx = mp.get_context("fork")
    out, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_adopt, args=("job", f"new-{i}", str(ram_folder), out, release)) for i in range(5)]
    for p in procs:
        p.start()
    taken = [out.get(timeout=30)[1] for _ in procs]
    release.set()
    for p in procs:
        p.join()
    assert sorted(t for t in taken if t) == sorted(orphans) and taken.count(None) == 2


def test_the_owner_mark_names_this_process():
    folder = snapshot_dir("job", "w")
    mark_owner(folder)
    assert snapshot_paths.owner_alive(folder) is True


def test_the_orphans_of_every_job_are_the_folders_whose_agent_is_dead():
    dead = _folder("job-a", "w0", owner=_a_dead_process(), shards=(3,))
    _folder("job-a", "w1", owner=_this_process(), shards=(3,))
    _folder("job-b", "w0", owner=None, shards=(3,))  # names no owner: never judged
    other_job = _folder("job-b", "w1", owner=_a_dead_process())
    assert sorted(snapshot_paths.orphaned_snapshot_dirs()) == sorted([dead, other_job])
