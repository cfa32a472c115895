"""The framing of the pipe between a worker's agent and its training process, and the training process's tie
to its agent's life; torch-free, imported by both sides."""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import threading
import time
from typing import Any


def send(conn: Any, message: Any) -> None:
    # Plain pickle: a Connection's own pickler shares tensors by file descriptor, which dies with the sender.
    conn.send_bytes(pickle.dumps(message))


def recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


def die_with_parent(agent_pid: int) -> None:
    """If the agent is killed (its node dies), this process must not live on training alone.

    A spawned training process is the agent's child: the kernel kills it when the agent dies
    (``PR_SET_PDEATHSIG``). One forked from the zygote is the fork server's child, and the fork server outlives
    the agent while any process it forked lives (each holds the fork server's keep-alive pipe): such a process
    watches the agent itself, on a thread that waits on the agent's pidfd and exits the process when it ends
    (and is not tied to the fork server's life, which is not the agent's)."""
    if os.getppid() != agent_pid:
        threading.Thread(target=_exit_when_gone, args=(agent_pid,), name="meridian-agent-watch", daemon=True).start()
    elif sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if not _alive(agent_pid):  # the agent died before we looked
        os._exit(1)


def _exit_when_gone(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3, not Linux) or already gone: poll
        while _alive(pid):
            time.sleep(0.2)
    else:
        select.select([fd], [], [])  # readable once the process has exited
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone (or its pid reused by another user's process)
        return False
    return True
