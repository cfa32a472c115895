"""Process state as the kernel reports it, for tests that kill processes."""

from __future__ import annotations

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
