"""Where a job's ``resume_from`` points, found and described at submit: the checkpoint folder, its step and its
fingerprint, read from the folder's ``meridian.json`` (no tensor is read here, and nothing imports torch).

``{"job": ID}`` reads the newest checkpoint of an ended job of the same owner (a running one still replaces its
checkpoints); ``{"checkpoint": LOCATION}`` a checkpoint folder (``step-N``) or a job's checkpoint directory
(its newest step) named by the same rule as a dataset: a path under the service's data roots or a URL under
its declared URL roots (:mod:`meridian.service.locations`), refused in the same words whether or not anything
is there. Whether the job may continue it is :func:`meridian.service.resolved.resolve`'s to decide.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meridian.service.errors import InvalidJob, JobNotFound
from meridian.service.jobs import ResumeRequest
from meridian.workers.state import storage

if TYPE_CHECKING:  # (the store keeps resolved jobs, which name this module's FoundCheckpoint)
    from meridian.service.data_access import DataAccess
    from meridian.service.store import JobRecord

SHARDED_META = storage.MARKERS[0]
"""The sharded checkpoint's description (``meridian.json``): its step and its job's fingerprint."""
SINGLE_FILE = storage.MARKERS[1]
"""The single-file format of earlier versions (``state.pt``), whose fingerprint only torch can read."""


@dataclass(frozen=True)
class FoundCheckpoint:
    """A complete checkpoint a job may start from, as its ``meridian.json`` describes it."""

    folder: str
    """The step folder (a path or URL)."""
    step: int
    fingerprint: dict[str, Any]
    source: str
    """What the job named, for messages and events: ``job <id>`` or the location."""


def find_checkpoint(resume: ResumeRequest, *, owner: str, get_job: Callable[[str], JobRecord],
                    access: DataAccess) -> FoundCheckpoint:
    """The checkpoint ``resume`` names, or :class:`InvalidJob` (a 422) naming the field and what to do."""
    if resume.job:
        return read_checkpoint(_job_directory(resume.job, owner, get_job), f"job {resume.job}")
    location = resume.checkpoint
    if storage.is_url(location) and not location.startswith("file://"):
        where = access.admit_url(location, "resume_from.checkpoint")
    else:
        where = access.admit_directory(location, "resume_from.checkpoint", "the checkpoint")
    return read_checkpoint(where, location)


def _job_directory(job_id: str, owner: str, get_job: Callable[[str], JobRecord]) -> str:
    missing = InvalidJob(f"resume_from.job {job_id!r} is not a job of yours; name the id of one "
                         "(`meridian list`), or its checkpoint's location in resume_from.checkpoint")
    try:
        job = get_job(job_id)
    except JobNotFound:
        raise missing from None
    if job.owner != owner:
        raise missing  # the same words as a missing job: nothing is learned about other owners' jobs
    if not job.status.state.is_terminal:
        raise InvalidJob(f"resume_from.job {job_id!r} is still {job.status.state.value} and still replaces its "
                         "checkpoints; cancel it (its newest checkpoint stays) or wait for its end, then submit again")
    directory = job.resolved.config.checkpoint_dir if job.resolved is not None else ""
    if not directory:
        raise InvalidJob(f"resume_from.job {job_id!r} kept no checkpoints (checkpoint.interval_steps 0 and "
                         "checkpoint.keep_final false); there is nothing to resume from")
    return directory


def read_checkpoint(location: str, source: str) -> FoundCheckpoint:
    """The checkpoint at ``location``: that step folder, or the newest complete one of a checkpoint directory."""
    try:
        text = storage.read_text(storage.join(location, SHARDED_META))
        if text is None:
            if storage.exists(storage.join(location, SINGLE_FILE)):
                raise InvalidJob(f"resume_from: {source} is a checkpoint in the single-file format of earlier "
                                 "versions, which cannot be described without reading it whole; resume the job "
                                 "that wrote it once (it then writes the sharded format) and name that")
            name = storage.latest(location)
            if name is None:
                raise InvalidJob(f"resume_from: {source} holds no complete checkpoint (a step-N folder with its "
                                 f"{SHARDED_META}); name a job's checkpoint directory or one of its step folders")
            return read_checkpoint(storage.join(location, name), source)
        meta = json.loads(text)
        return FoundCheckpoint(folder=location, step=int(meta["step"]), fingerprint=dict(meta["fingerprint"]),
                               source=source)
    except InvalidJob:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidJob(f"resume_from: the checkpoint of {source} ({location}) has an unreadable {SHARDED_META} "
                         f"({type(e).__name__}: {e}); name another checkpoint") from None
    except OSError as e:
        raise InvalidJob(f"resume_from: the checkpoint of {source} ({location}) cannot be read ({e}); check the "
                         "storage is reachable from the service, then submit again") from None
