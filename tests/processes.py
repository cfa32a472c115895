"""Process state as the kernel reports it, for tests that kill processes."""

from __future__ import annotations

import os
from pathlib import Path

from meridian.lab import lab
from meridian.lab.lab import process_exited


def is_gone(pid: int) -> bool:
    """The process has exited: no longer listed, or a zombie its parent has not reaped yet (the lab's own test
    of a killed node's processes)."""
    return process_exited(pid)


def process_line(pid: int) -> str:
    """The kernel's one-line status of ``pid`` (state, parent, ...), for an assertion's message."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().strip()
    except OSError:
        return f"{pid}: not listed"


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` in the process tree (children, theirs, ...), from /proc."""
    return set(lab.descendants([pid])) - {pid}


def sleep_tied_to_agent(agent_pid: int, conn) -> None:
    """A stand-in for a training process busy in a step (not reading its pipe): tied to its agent's life as
    a real one is, then asleep."""
    import time

    from meridian.workers.elastic.pipe import die_with_parent

    die_with_parent(agent_pid)
    conn.send(os.getpid())
    time.sleep(600)
