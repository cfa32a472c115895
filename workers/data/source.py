"""How a job's text ``data.source`` file is read, by its workers and by the service that admits it; torch-free.

One way to open it for both: non-blocking and not through a symlink as the last part (a named pipe cannot hang
the reader, a path swapped for a link after the service checked it is refused), regular files only, at most
``max_bytes``. The service pins a job to the hash of those bytes (:class:`~meridian.workers.contracts.config.
DataPin`) and the workers refuse a file whose bytes have changed since.
"""

from __future__ import annotations

import hashlib
import os

from meridian.workers.contracts.regular_files import NotRegularFile, open_regular

HELD_OUT_FRACTION = 0.05
"""The last 5 % of a text's bytes are held out for the evaluation loss."""


def split_bytes(size: int, split: str) -> tuple[int, int]:
    """``[start, stop)`` of the ``size`` bytes a job reads of its text that ``split`` holds: ``train``, the first
    95 %; any other, the held-out rest."""
    cut = int(size * (1 - HELD_OUT_FRACTION))
    return (0, cut) if split == "train" else (cut, size)


def read_source(path: str, max_bytes: int, *, where: str = "on this node") -> bytes:
    """The first ``max_bytes`` bytes of the regular file ``path``; ``ValueError`` naming it otherwise."""
    try:
        fd = open_regular(path)
    except OSError as e:
        raise ValueError(f"data.source {path!r} cannot be read {where}: {e.strerror}") from None
    except NotRegularFile:
        raise ValueError(f"data.source {path!r} is not a regular file {where}") from None
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes)


def source_sha256(text: bytes) -> str:
    """What a text source is pinned by: the hash of the bytes a job reads (text appended past ``max_bytes``
    changes nothing the job trains on, so it is not a change)."""
    return hashlib.sha256(text).hexdigest()
