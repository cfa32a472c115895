"""The framing of the pipe between a worker's agent and its training process, and the training process's tie
to its agent's life; torch-free, imported by both sides."""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import Any


def send(conn: Any, message: Any) -> None:
    # Plain pickle: a Connection's own pickler shares tensors by file descriptor, which dies with the sender.
    conn.send_bytes(pickle.dumps(message))


def recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


def die_with_parent(parent_pid: int) -> None:
    """If the agent is killed (its node dies), this process must not live on training alone."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
