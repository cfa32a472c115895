"""Process state as the kernel reports it, for tests that kill processes, and process groups that end with the
test that started them, whatever happens to the test."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
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


# The guard of a process group: it waits on a pipe from the test process and kills the group (and every process
# below its leader) when the pipe closes without the word "done", which is how a test process that died
# (SIGKILL, pytest-timeout's os._exit, a crash) leaves it. Only the standard library, nothing of Meridian.
GUARD = r"""
import os, signal, sys

def tree(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out

leader = int(sys.argv[1])
if sys.stdin.buffer.read() != b"done":
    below = tree(leader)
    try:
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
"""


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader: a zombie still counts as a member of its group
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def end_group(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """End ``proc``'s process group: ``grace_s`` for it to end by itself (a service stopping its cluster), then
    SIGTERM for up to 30 s, then SIGKILL; and SIGKILL to every process that was below the leader, wherever its
    group."""
    below = descendants(proc.pid)  # before the leader goes: its orphans are re-parented away from it
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if sig is not None and _group_alive(proc):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while _group_alive(proc) and time.monotonic() < deadline:
            time.sleep(0.25)
    for pid in below:
        if not is_gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def process_group(argv: list[str], *, grace_s: float = 0.0, **popen) -> Iterator[subprocess.Popen]:
    """``argv`` started as the leader of a session and process group of its own (``start_new_session``), so that
    a terminal's Ctrl-C reaches the test, not it; on leaving the block (the test passed, failed or timed out),
    :func:`end_group` ends the group and everything below the leader. A guard process does the same if this
    process dies before it leaves the block."""
    proc = subprocess.Popen(argv, start_new_session=True, **popen)
    guard = subprocess.Popen([sys.executable, "-I", "-S", "-c", GUARD, str(proc.pid)], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        yield proc
    finally:
        try:
            end_group(proc, grace_s)
        finally:
            with contextlib.suppress(BrokenPipeError):
                guard.stdin.write(b"done")
                guard.stdin.close()
            guard.wait(timeout=30)
