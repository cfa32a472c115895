"""Let a leaving training process's peers know at once: shut its TCP connections down before it exits.

A rank whose collective failed leaves with ``os._exit``, and its peers that still wait on it inside a collective
fail only when its sockets close. The kernel closes a process's files after it has torn down the process's
memory (``do_exit`` runs ``exit_mm`` before ``exit_files``), and for a torch process that teardown takes tens
of milliseconds, which sat on the critical path of every re-formation: the last survivor to fail was the one
blocked on a peer that had already failed. ``shutdown(SHUT_RDWR)`` sends the FIN now, while the descriptor
stays open (another thread may still poll it) until the exit closes it.
"""

from __future__ import annotations

import contextlib
import os
import socket

TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def shut_down_tcp_sockets() -> int:
    """Shut down every connected TCP socket this process holds (gloo's pairs, store connections); the number
    shut. Listening sockets and Unix sockets (the agent's pipe) are left alone."""
    shut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):  # not a socket, or closed since the listing
            continue
        try:
            if sock.family in TCP_FAMILIES and sock.type == socket.SOCK_STREAM:
                with contextlib.suppress(OSError):  # not connected (a listener), or closed by the peer already
                    sock.getpeername()  # listeners are left alone: gloo's listener thread aborts the process
                    sock.shutdown(socket.SHUT_RDWR)  # when its socket is shut down under its accept()
                    shut += 1
        finally:
            sock.detach()  # the descriptor stays open: whatever polls it sees the shutdown, not a reused number
    return shut
