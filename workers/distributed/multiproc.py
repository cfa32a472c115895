"""Run a function on N local processes joined in one torch.distributed group (gloo).

Used by the math tests and the sync benchmarks: real multi-process collectives on one machine, without Ray.
Each process gets ``(rank, world_size, *args)``; the return values come back in rank order. A rank that
raises, dies or outlives ``timeout_s`` fails the whole run with a message that names it, and every other
process is killed: a test never hangs on a peer stuck in a collective. A rank whose caller is gone (killed by a
signal, so its clean-up never ran) exits too, rather than training on for nobody.

The ranks are forked from this process's zygote (:mod:`meridian.workers.distributed.zygote`: a fork server that
imported torch and the training stack once, started by the first run), not spawned: a spawned rank spends
seconds of CPU importing torch before it does anything, and the math tests start hundreds of ranks on two cores.
A rank takes this process's environment, working directory, stdout and stderr as they are at the call
(:func:`~meridian.workers.distributed.zygote.zygote_process`), as a spawned one would.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from meridian.workers.distributed.ports import free_port
from meridian.workers.distributed.zygote import zygote_context, zygote_process


class RankFailed(RuntimeError):
    """A rank raised, died or timed out."""


def _exit_with(caller: int) -> None:
    """End this rank as soon as process ``caller`` exits (a rank's parent is the zygote, not the caller)."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(caller)
        except ProcessLookupError:
            os._exit(1)
        except OSError:  # no pidfd here: poll
            while True:
                time.sleep(1.0)
                try:
                    os.kill(caller, 0)
                except ProcessLookupError:
                    os._exit(1)
        select.select([fd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="caller-watch", daemon=True).start()


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results: Any,
           caller: int) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    _exit_with(caller)

    # One intra-op thread per rank: N ranks share the machine's cores, and oversubscription makes
    # timings noisy without making anything faster.
    torch.set_num_threads(int(os.environ.get("MERIDIAN_THREADS_PER_RANK", "1")))
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        )
        out = fn(rank, world_size, *args)
        # Plain pickle, by value: through the queue torch would share tensors by file descriptor, and
        # this process exits before the parent opens them ("connection reset by peer").
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report any failure to the parent, with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_processes(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function). Raises :class:`RankFailed`.
    """
    ctx = zygote_context()
    results = ctx.Queue()
    port = free_port()
    procs = [zygote_process(_entry, (fn, r, world_size, port, args, results, os.getpid())) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RankFailed(f"ranks {missing} did not finish within {timeout_s:.0f} s") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
