"""A started training process waiting for its agent's ``go``, and the pipe both speak; torch-free to import.

Kept apart from :mod:`meridian.workers.elastic.agent` (which imports torch) so a worker can start its first
standby before it imports torch itself: the child's imports (torch and the training stack, seconds) then
run while the worker's own do, instead of after them. That is most of a joining worker's start-up, so it
is most of a scale-up's time.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from meridian.workers.elastic.pipe import die_with_parent, recv, send


def _standby_main(conn: Any, parent_pid: int) -> None:
    """A training process that has started and imported everything, waiting for the agent's ``go``."""
    die_with_parent(parent_pid)
    # The heavy imports (torch, the training stack), paid for before they are needed.
    import meridian.workers.elastic.rendezvous  # noqa: F401
    import meridian.workers.elastic.trainer  # noqa: F401
    from meridian.workers.elastic.child import child_main

    # Beside the wait, not before it: a ``go`` that comes while this still runs (a failure soon after the
    # previous process started, on a loaded machine) starts training at once, the import finishing meanwhile.
    threading.Thread(target=prewarm_torch, name="meridian-prewarm", daemon=True).start()

    try:
        msg = recv(conn)
    except (EOFError, ConnectionResetError):
        os._exit(0)  # the agent is done with us
    if msg[0] != "go":
        os._exit(0)
    _, cfg, ids, store_dir, device, threads = msg
    child_main(conn, cfg, ids, store_dir, device, threads)


def prewarm_torch() -> None:
    """Pay now for what torch imports lazily on a training process's first optimizer step: torch._dynamo
    (pulled in by the optimizers' ``_disable_dynamo`` wrappers; sympy and ~800 modules) and DTensor. Measured
    here: 3.1 s at load 20, which a re-formed epoch's first step otherwise waited for, on every rank. Safe
    beside the training thread: its own tensors only, and imports are locked per module."""
    with contextlib.suppress(Exception):  # only a head start: the training process imports what it needs anyway
        _prewarm()


def _prewarm() -> None:
    import torch
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p])
    p.grad = torch.zeros(2)
    opt.step()
    opt.zero_grad()


class Standby:
    """A started training process and the agent's end of its pipe."""

    def __init__(self, ctx: Any, worker_id: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_standby_main, args=(child, os.getpid()), name=f"meridian-trainer-{worker_id}",
                                daemon=True)  # fmt: skip
        self.proc.start()
        child.close()

    def go(self, *args: Any) -> None:
        send(self.conn, ("go", *args))

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()  # the standby reads EOF and exits
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def start_standby(worker_id: str) -> Standby:
    """Start a standby now (spawned: a fresh interpreter, safe beside Ray's threads)."""
    import multiprocessing as mp

    return Standby(mp.get_context("spawn"), worker_id)
