"""What a job wrote to its storage: the durable checkpoints under ``<checkpoint root>/<job id>/``, the last of
which holds the final weights (every job keeps them unless ``checkpoint.keep_final`` is false).

Torch-free: the listing reads directory entries and the ``latest`` pointer of
:mod:`meridian.workers.state.checkpoint`'s layout, never the tensors. ``meridian export`` reads the path
given here (the service's data dir, which on one machine every node shares) and converts the checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meridian.service.store import JobRecord
from meridian.workers.contracts.fields import to_plain


def list_artifacts(checkpoint_root: str, job: JobRecord) -> dict[str, Any]:
    """The job's storage folder, each complete checkpoint (step, path, files and bytes), and the latest one."""
    root = Path(checkpoint_root) / job.id
    items: list[dict[str, Any]] = []
    latest = None
    if root.is_dir():
        pointer = root / "latest"
        if pointer.is_file():
            latest = str(root / pointer.read_text().strip())
        for step_dir in sorted(p for p in root.glob("step-*") if p.is_dir()):
            files = [{"name": f.name, "bytes": f.stat().st_size} for f in sorted(step_dir.iterdir()) if f.is_file()]
            step = int(step_dir.name.removeprefix("step-"))
            items.append({
                "kind": "checkpoint", "step": step, "path": str(step_dir), "files": files,
                "bytes": sum(f["bytes"] for f in files), "final": step == job.request.steps,
            })
    return {
        "job_id": job.id, "storage": str(root), "exists": root.is_dir(), "latest": latest,
        "keep_final": job.request.keep_final, "model": to_plain(job.request.model),
        "data": to_plain(job.request.data), "artifacts": items,
        "readable_here": latest is not None and os.access(latest, os.R_OK),
    }
