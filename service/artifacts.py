"""What a job wrote to its storage: the durable checkpoints under ``<checkpoint root>/<job id>/`` (a folder or
an fsspec URL), the last of which holds the final weights (every job keeps them unless
``checkpoint.keep_final`` is false), and its trackers' logs there (``tensorboard/``, ``wandb/``).

Torch-free: the listing reads file names, sizes and the ``latest`` pointer
(:mod:`meridian.workers.state.storage`), never the tensors, and shows only complete checkpoints (those with
their marker file: a save in progress or a crashed one is not listed). ``meridian export`` reads the path or
URL given here and converts the checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

from meridian.service.errors import StorageUnreadable
from meridian.service.store import JobRecord
from meridian.workers.contracts.fields import to_plain
from meridian.workers.state import storage


def list_artifacts(checkpoint_root: str, job: JobRecord) -> dict[str, Any]:
    """The job's storage folder, each complete checkpoint (step, path, files and bytes), and the latest one."""
    root = storage.join(checkpoint_root, job.id)
    try:
        folders = storage.step_folders(root)
        pointer = storage.latest(root)
    except Exception as e:  # an object store's errors are its library's own types
        raise StorageUnreadable(f"cannot list {root} ({type(e).__name__}: {e}); check the service's credentials "
                                "for it (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)") from e
    items: list[dict[str, Any]] = []
    for name in storage.complete(folders):
        files = [{"name": n, "bytes": b} for n, b in sorted(folders[name].items())]
        step = int(name.removeprefix(storage.PREFIX))
        items.append({
            "kind": "checkpoint", "step": step, "path": storage.join(root, name), "files": files,
            "bytes": sum(f["bytes"] for f in files), "final": step == job.request.steps,
        })
    latest = storage.join(root, pointer) if pointer else None
    url = storage.is_url(root)
    tracking = job.request.tracking
    logs: dict[str, Any] = {}
    for name in ("tensorboard", "wandb"):  # what rank 0's trackers wrote into the job's folder
        folder = storage.join(root, name)
        files = storage.list_files(folder)
        if files:
            logs[name] = {"path": folder, "files": [{"name": n, "bytes": b} for n, b in sorted(files.items())],
                          "bytes": sum(files.values())}
    if tracking is not None and tracking.mlflow is not None:
        logs["mlflow"] = {"uri": tracking.mlflow.uri or f"file:{storage.join(root, 'mlflow')}",
                          "experiment": tracking.mlflow.experiment}
    return {
        "job_id": job.id, "storage": root, "exists": bool(folders) or pointer is not None or os.path.isdir(root),
        "latest": latest, "keep_final": job.request.keep_final, "model": to_plain(job.request.model),
        "data": to_plain(job.request.data), "artifacts": items, "tracking": logs,
        "readable_here": latest is not None and (url or os.access(latest, os.R_OK)),
    }
