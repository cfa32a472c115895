"""How the WAN emulator names its shared files (:mod:`meridian.workers.wan.link`), torch-free: the service's
end-of-job sweep (:func:`meridian.workers.state.snapshot_paths.remove_snapshot_dirs`) finds a killed job's files
by the same rules the emulator wrote them with.

A file is ``<shm_dir>/<FILE_PREFIX><key>+<what>``; a key is :func:`key_stem` of its prefix, ``.``, then random hex
(``link.agree_key``); a job's prefix is :func:`job_key_prefix` of its id and epoch."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile

FILE_PREFIX = "meridian-wan-"
"""Every shared file of the emulator is ``<FILE_PREFIX><key>+<what>``."""


def shm_dir() -> str:
    """Where the shared link files live: ``/dev/shm`` (RAM) if writable, else the temp directory."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def safe_name(name: str) -> str:
    """``name`` as it may stand in a file name: itself when short and plain, else cut and hashed."""
    if re.fullmatch(r"[A-Za-z0-9_.\-]{1,40}", name):
        return name
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)[:24] + "_" + hashlib.sha1(name.encode()).hexdigest()[:8]


def key_stem(prefix: str) -> str:
    """A key's prefix as its files' names carry it, before the run's random hex."""
    return safe_name(prefix)[:48]


def job_key_prefix(job_id: str, epoch: int) -> str:
    """The prefix of a job's keys in ``epoch``: a fresh key per epoch, so the files of a broken epoch are never
    read by the next one."""
    return f"job-{job_id}" + (f"-e{epoch}" if epoch else "")


def is_job_stem(stem: str, job_id: str) -> bool:
    """Whether ``stem`` (:func:`key_stem`) is one of ``job_id``'s, of any epoch."""
    later = re.fullmatch(r".*-e([0-9]+)", stem)  # the epoch a stem names, if any; the first epoch names none
    epochs = [0] + ([int(later.group(1))] if later else [])
    return any(stem == key_stem(job_key_prefix(job_id, epoch)) for epoch in epochs)
