"""Process state as the kernel reports it, for tests that kill processes."""

from __future__ import annotations

import os
from pathlib import Path


def is_gone(pid: int) -> bool:
    """The process has exited: no longer listed, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def process_line(pid: int) -> str:
    """The kernel's one-line status of ``pid`` (state, parent, ...), for an assertion's message."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().strip()
    except OSError:
        return f"{pid}: not listed"


def sleep_tied_to_agent(agent_pid: int, conn) -> None:
    """A stand-in for a training process busy in a step (not reading its pipe): tied to its agent's life as
    a real one is, then asleep."""
    import time

    from meridian.workers.elastic.pipe import die_with_parent

    die_with_parent(agent_pid)
    conn.send(os.getpid())
    time.sleep(600)
