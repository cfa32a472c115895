"""A started training process waiting for its agent's ``go``, and the pipe both speak; torch-free to import.

Kept apart from :mod:`meridian.workers.elastic.agent` (which imports torch) so a worker can start its first
standby before it imports torch itself: the child's imports (torch and the training stack, seconds) then
run while the worker's own do, instead of after them. That is most of a joining worker's start-up, so it
is most of a scale-up's time.

On CPU, standbys are forked from a *zygote* (:mod:`meridian.workers.distributed.zygote`): a fork server that
imported the training stack once, when the agent's first standby started. Every later standby (the one started
beside each training process, so that a restart is a pipe message) is then a fork of it: measured here,
1.05–1.20 CPU-seconds with its prewarm, where a spawned one took 5.2 (4–6 on other runs). Those seconds ran
beside training at the start of every job and after every re-formation, on every worker: on two cores shared by
four workers the first ~20 steps of a job ran 2–3× slower. On a GPU standbys are still spawned: a fork server
that ever touched CUDA would hand its children a CUDA they cannot use, and that is not checked on a GPU yet.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from meridian.workers.distributed.zygote import zygote_context
from meridian.workers.elastic.pipe import die_with_parent, recv, send


def standby_context(device: str = "cpu") -> Any:
    """How this worker starts its training processes: forked from the zygote on CPU, spawned on a GPU."""
    import multiprocessing as mp

    if device.startswith("cuda"):
        return mp.get_context("spawn")
    return zygote_context()


def _standby_main(conn: Any, agent_pid: int) -> None:
    """A training process that has started and imported everything, waiting for the agent's ``go``."""
    die_with_parent(agent_pid)
    # The heavy imports (torch, the training stack), paid for before they are needed (a fork of the zygote
    # has them already).
    import meridian.workers.elastic.trainer  # noqa: F401
    from meridian.workers.elastic.child import child_main
    from meridian.workers.elastic.rendezvous import prehost_store

    # Beside the wait, not before it: a ``go`` that comes while this still runs (a failure soon after the
    # previous process started, on a loaded machine) starts training at once, the import finishing meanwhile.
    threading.Thread(target=prewarm_torch, name="meridian-prewarm", daemon=True).start()
    store = prehost_store()  # its first join's store, ready before the go

    try:
        msg = recv(conn)
        if msg[0] == "prepare":  # the job's datasets and initial model, built while this waits
            _prepare(msg[1])
            msg = recv(conn)
    except (EOFError, ConnectionResetError):
        os._exit(0)  # the agent is done with us
    if msg[0] != "go":
        os._exit(0)
    _, cfg, ids, store_dir, device, threads = msg
    child_main(conn, cfg, ids, store_dir, device, threads, store)


def _prepare(cfg: Any) -> None:
    """:func:`meridian.workers.loop.prepared.prepare`, as a head start only: what fails here (a missing data file)
    fails again after the ``go``, where it is reported."""
    from meridian.workers.loop.prepared import prepare

    with contextlib.suppress(Exception):
        prepare(cfg)


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
    """A started training process and the agent's end of its pipe.

    The process starts on a thread of its own: a fork server's first fork waits until the zygote has imported
    everything (seconds), and neither the worker's own imports nor the agent's relay of its training process's
    messages should wait for that. :meth:`go` and :meth:`discard` wait for the start. Given the job's ``cfg``, the
    process builds its datasets and initial model once started (:mod:`meridian.workers.loop.prepared`), before
    the ``go`` that a re-formation waits for."""

    def __init__(self, ctx: Any, worker_id: str, cfg: Any = None) -> None:
        self.conn, child = ctx.Pipe()
        self._process = lambda: ctx.Process(target=_standby_main, args=(child, os.getpid()),
                                            name=f"meridian-trainer-{worker_id}", daemon=True)  # fmt: skip
        self.proc = self._process()
        self._start_error: BaseException | None = None
        self._starting = threading.Thread(target=self._start, args=(child, cfg), name="meridian-standby-start",
                                          daemon=True)  # fmt: skip
        self._starting.start()

    def _start(self, child: Any, cfg: Any) -> None:
        try:
            try:
                self.proc.start()
            except (EOFError, ConnectionError):
                # The fork server's end of the connection closed (it died): multiprocessing starts a new one for
                # the next process, so one more try, before the worker gives up on training here.
                self.proc = self._process()
                self.proc.start()
        except BaseException as e:  # noqa: BLE001 - go() raises it
            self._start_error = e
            return
        finally:
            child.close()
        if cfg is not None:
            with contextlib.suppress(OSError):  # it died already: the go says so
                send(self.conn, ("prepare", cfg))  # before any go (go() waits for this thread)

    def started(self) -> None:
        """Wait for the process to have started; raise ``OSError`` if it could not."""
        self._starting.join()
        if self._start_error is not None:
            raise OSError(f"the standby training process did not start: {self._start_error!r}")

    def go(self, *args: Any) -> None:
        self.started()
        send(self.conn, ("go", *args))

    def discard(self) -> None:
        self._starting.join()
        with contextlib.suppress(OSError):
            self.conn.close()  # the standby reads EOF and exits
        if self._start_error is not None:
            return
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def start_standby(worker_id: str, device: str = "cpu") -> Standby:
    """Start a standby now: from the zygote (started now, if this is the first) or spawned, by ``device``. Both
    begin from a fresh interpreter, safe beside Ray's threads."""
    return Standby(standby_context(device), worker_id)
