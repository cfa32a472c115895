"""This process's *zygote*: one fork server that imported torch and the training stack once. Every CPU process this
process starts to train or to run collectives (an agent's standby training process, a rank of
:func:`~meridian.workers.distributed.multiproc.run_processes`) is a fork of it, so it does not spend seconds of
CPU on those imports again, beside the processes already training.

``multiprocessing`` keeps one fork server per process, and it preloads the modules named before it first starts;
a list named later is silently ignored. So every caller takes the fork server from here, with the one list.
"""

from __future__ import annotations

import multiprocessing as mp
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
