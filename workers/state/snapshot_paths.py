"""Where a worker keeps its in-memory snapshots, and removing a job's leftovers.

Kept free of torch so the job runner can sweep a node with a task that starts in a fraction of a second.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile


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


def remove_snapshot_dirs(job_id: str) -> list[str]:
    """Remove this host's snapshot folders of ``job_id`` (a killed worker's folder outlives it); the removed."""
    removed = snapshot_dirs(job_id)
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed
