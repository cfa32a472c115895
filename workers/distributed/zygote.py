"""This process's *zygote*: one fork server that imported torch and the training stack once. Every CPU process this
process starts to train or to run collectives (an agent's standby training process, a rank of
:func:`~meridian.workers.distributed.multiproc.run_processes`) is a fork of it, so it does not spend seconds of
CPU on those imports again, beside the processes already training.

``multiprocessing`` keeps one fork server per process, and it preloads the modules named before it first starts;
a list named later is silently ignored. So every caller takes the fork server from here, with the one list.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

ZYGOTE_IMPORTS = (
    "meridian.workers.elastic.rendezvous", "meridian.workers.elastic.trainer", "meridian.workers.elastic.child",
)  # fmt: skip
"""What the zygote imports before its first fork: the training stack (torch with it), what a spawned standby
imports before it waits. Imports only: a process that ran torch's thread pools must not fork. Not what torch
imports lazily on a first optimizer step (``prewarm_torch`` in :mod:`meridian.workers.elastic.standby`: each
standby does that beside its wait, ~0.7 CPU-seconds): in the zygote it would delay every worker's first training
process, and so a scale-up's join (measured: 3.6–4.5 s from a returning worker's start to its join, against
2.0 s without the zygote)."""


def zygote_context() -> Any:
    """The ``multiprocessing`` context whose processes are forks of this process's zygote (started by its first
    process, which waits for the imports)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(ZYGOTE_IMPORTS))
    return ctx


def zygote_process(target: Callable[..., Any], args: tuple, *, daemon: bool = True) -> Any:
    """A (not yet started) fork of the zygote that runs ``target(*args)`` with this process's environment,
    working directory, stdout and stderr as they are now, as a spawned process would: the zygote's are those of
    the moment it started (whichever caller that was), so a crash report would otherwise land elsewhere."""
    caller = (dict(os.environ), os.getcwd(), _CallersFd.of(1), _CallersFd.of(2))
    return zygote_context().Process(target=_as_caller, args=(caller, target, args), daemon=daemon)


def _as_caller(caller: tuple, target: Callable[..., Any], args: tuple) -> Any:
    env, cwd, stdout, stderr = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, into in ((stdout, 1), (stderr, 2)):
        if fd is not None:
            os.dup2(fd, into)
            os.close(fd)
    return target(*args)


class _CallersFd:
    """File descriptor ``fd`` of the calling process, handed to the fork as it starts: ``Process.start()`` sends a
    copy to the fork server with the process's own descriptors, and in the fork this unpickles as that copy's
    number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def of(cls, fd: int) -> _CallersFd | None:
        """``fd`` if this process has it open (a daemon may have closed its output), else ``None``."""
        try:
            os.fstat(fd)
        except OSError:
            return None
        return cls(fd)

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _CallersFd._in_fork, (reduction.DupFd(self.fd),)  # pickled by Process.start(): queued to send

    @staticmethod
    def _in_fork(dup: Any) -> int:
        return dup.detach()
