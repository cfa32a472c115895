"""Where a worker keeps its in-memory snapshots, and removing a job's leftovers.

Kept free of torch so the job runner can sweep a node with a task that starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from meridian.workers.wan.file_names import FILE_PREFIX, is_job_stem, shm_dir

OWNER_FILE = "owner"
"""In a snapshot folder: the pid and start time of the agent that keeps it (a worker's long-lived process)."""


def _snapshot_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def snapshot_dir(job_id: str, worker_id: str) -> str:
    """A per-worker folder in RAM where there is one (``/dev/shm``), else in the temp folder."""
    return os.path.join(_snapshot_root(), f"meridian-snapshots.{_safe(job_id)}.{_safe(worker_id)}")


def snapshot_dirs(job_id: str) -> list[str]:
    """This host's snapshot folders of ``job_id``, every worker's."""
    return glob.glob(os.path.join(_snapshot_root(), f"meridian-snapshots.{glob.escape(_safe(job_id))}.*"))


def every_snapshot_pattern() -> str:
    """The glob of this host's snapshot folders, of every job."""
    return os.path.join(_snapshot_root(), "meridian-snapshots.*.*")


def every_snapshot_dir() -> list[str]:
    """This host's snapshot folders, of every job."""
    return glob.glob(every_snapshot_pattern())


def orphaned_snapshot_dirs() -> list[str]:
    """This host's snapshot folders, of any job, whose agent is dead (it marked its folder, and that process is
    gone): kept for a new worker of the same job to take over, and garbage once the job has ended."""
    return [folder for folder in every_snapshot_dir() if owner_alive(folder) is False]


def remove_snapshot_dirs(job_id: str) -> list[str]:
    """Remove this host's snapshot folders of ``job_id`` (a killed worker's folder outlives it), and the job's
    emulated-WAN link files (:func:`wan_link_files`, which a killed training process leaves too); the removed."""
    removed = snapshot_dirs(job_id)
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    for path in wan_link_files(job_id):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


# -- the WAN emulator's shared files of a job (named by :mod:`meridian.workers.wan.file_names`) ------------------
def wan_link_files(job_id: str) -> list[str]:
    """This host's emulated-WAN link files of ``job_id``'s epochs. Each epoch's processes remove their own when they
    end on their own; a process killed (a cancelled job's, a service's cluster that went) leaves them in RAM. A job
    id whose key the WAN emulator hashes (not ``[A-Za-z0-9_.-]``, or over ~30 characters) is not found; the
    service's ids are 12 hex digits."""
    directory = shm_dir()
    found = []
    for name in os.listdir(directory):
        if not name.startswith(FILE_PREFIX):
            continue
        key = name[len(FILE_PREFIX):].split("+", 1)[0]
        if "." in key and is_job_stem(key.rsplit(".", 1)[0], job_id):
            found.append(os.path.join(directory, name))
    return found


# -- a folder whose worker died, taken over by a new worker of the job on the same host ---------------------------
def _process_start(pid: int) -> str | None:
    """``pid``'s start time (clock ticks since boot, /proc/<pid>/stat field 22), or ``None`` if no such process:
    a pid and its start time name one process, a reused pid does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(folder: str) -> bool | None:
    """Whether the agent that wrote ``folder``'s owner file lives; ``None`` when the folder names no owner."""
    try:
        pid, start = Path(folder, OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return None
    return _process_start(int(pid)) == start


def mark_owner(folder: str) -> None:
    """Make ``folder`` (created if missing) this process's: written by the agent that keeps it."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{OWNER_FILE}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {_process_start(os.getpid())}")
    os.replace(tmp, os.path.join(folder, OWNER_FILE))


@contextlib.contextmanager
def _adoption_lock() -> Iterator[None]:
    """One adopter at a time on this host (a job's agents share its RAM folder): a lock on that folder itself, so
    no lock file is left behind."""
    fd = os.open(_snapshot_root(), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def adopt_orphan(job_id: str, worker_id: str) -> str | None:
    """Take over a snapshot folder of ``job_id`` on this host whose agent is dead, as ``worker_id``'s (renamed to
    :func:`snapshot_dir`, owned by this process); the folder taken, or ``None`` (then this worker's folder is new
    and empty). The newest one is taken: its shards are the ones most likely to reach the step a re-formed job
    resumes at. A folder that names no owner is never taken.

    What it is for: when every worker of a job ended at once while their nodes stayed up (Ray Train's controller
    failed and shut its workers down, and the runner started a new Train run), the new workers carry the dead
    ones' shards into the rendezvous instead of the job restarting from its last durable checkpoint or step 0.
    """
    mine = snapshot_dir(job_id, worker_id)
    with _adoption_lock():
        shutil.rmtree(mine, ignore_errors=True)
        orphans = [d for d in snapshot_dirs(job_id) if d != mine and os.path.isdir(d) and owner_alive(d) is False]
        taken = None
        for folder in sorted(orphans, key=_newest_shard, reverse=True):
            try:
                os.rename(folder, mine)
            except OSError:
                continue
            taken = folder
            break
        mark_owner(mine)
    return taken


def _newest_shard(folder: str) -> str:
    return max((n for n in os.listdir(folder) if n.startswith("shard-")), default="")
