"""Opening a file a job names, safely: a regular file, not through a symlink as its last part, never blocking on
a pipe. Shared by what reads a job's own files before any torch is loaded (its Hugging Face ``config.json``, its
dataset's sources)."""

from __future__ import annotations

import os
import stat


class NotRegularFile(Exception):
    """What :func:`open_regular` opened is not a regular file (a directory, a pipe, a device)."""


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``, opened non-blocking and not through a symlink as its
    last part (a named pipe cannot hang the reader; a path swapped for a link after it was checked is refused).
    ``OSError`` when it cannot be opened (a symlink among the reasons), :class:`NotRegularFile` when it is not a
    regular file; each caller says which in its own words."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(path)
    return fd
