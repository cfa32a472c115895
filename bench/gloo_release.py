"""``meridian bench gloo-release``: can survivors of a dead rank leave a gloo collective without any process exiting?

    meridian bench gloo-release --json [--modes keep abort abort-drop]

Why it is here: Meridian re-forms after a peer's death by ending every survivor's training process
(:mod:`meridian.workers.elastic.agent`), because a survivor blocked in a collective on a *live* peer that already
failed stays blocked until that peer's sockets close. This measures what closes them, in one process per rank
(spawned), on 4 ranks over gloo on this host:

- each rank all-reduces ``--numel`` floats once (warm-up), ranks 0 and 1 also on a 2-rank subgroup;
- rank 0 then starts an all-gather on the subgroup that rank 1 never joins (an operation still in flight, as the
  engine's communication thread or an async parameter gather leaves one), and every rank starts a second
  all-reduce, which rank 3 leaves by exiting ``--die-after-s`` seconds in;
- a survivor whose all-reduce failed then does what ``mode`` says and stays alive until every survivor has
  failed, or ``--linger-s`` has passed: ``keep`` nothing, ``abort`` calls ``abort()`` on its groups and keeps
  them, ``abort-drop`` calls ``abort()`` and drops every reference to its groups and their works (no
  ``gc.collect()``, which took 0.4 s of a torch process's heap).

Per mode: when each survivor's all-reduce failed (seconds after rank 3's exit), how long its clean-up took, and
whether the last survivor was released while the others still lived (``released_in_process``) or only once they
exited after ``--linger-s``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import time
from typing import Any

NAME = "gloo-release"
HELP = "after a rank dies: does abort(), or abort() and dropping the group, release survivors blocked on live peers?"
MODES = ("keep", "abort", "abort-drop")
WORLD = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--numel", type=int, default=8_000_000, help="floats per all-reduce (default 8M: 32 MB)")
    p.add_argument("--die-after-s", type=float, default=0.3)
    p.add_argument("--linger-s", type=float, default=5.0,
                   help="the survivors exit this long after the first of them failed if one is still blocked")
    p.add_argument("--timeout-s", type=float, default=60.0, help="gloo's collective timeout")


def _rank(rank: int, port: int, mode: str, args: dict[str, Any], reports: Any, release: Any) -> None:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args["timeout_s"])
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("world", store), rank, WORLD, timeout)
    pair = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, timeout) if rank < 2 else None
    x = torch.ones(args["numel"])
    group.allreduce([x]).wait()
    if pair is not None:
        pair.allreduce([torch.ones(8)]).wait()
    died_at = time.time() + args["die_after_s"]  # the ranks left the warm-up within a few ms of each other
    if rank == WORLD - 1:
        time.sleep(max(0.0, died_at - time.time()))
        os._exit(1)
    pending = pair.allgather([[torch.empty(8) for _ in range(2)]], [torch.ones(8)]) if rank == 0 else None
    work = group.allreduce([x])
    try:
        work.wait()
        reports.put((rank, {"failed": False}))
        return
    except Exception as e:  # noqa: BLE001 - the failure is what is measured
        failed = time.time()
        error = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0])[:120]  # less gloo's source line
    began = time.perf_counter()
    if mode in ("abort", "abort-drop"):
        group.abort()
        if pair is not None:
            pair.abort()
    if mode == "abort-drop":
        del group, pair, work, pending
    cleanup_s = time.perf_counter() - began
    reports.put((rank, {"failed": True, "failed_after_death_s": round(failed - died_at, 3),
                        "cleanup_s": round(cleanup_s, 3), "error": error}))  # fmt: skip
    reports.close()
    reports.join_thread()  # the report is sent before this process can exit
    release.wait(args["linger_s"] + args["timeout_s"])
    os._exit(0)


def _one(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp
    import queue

    from meridian.workers.distributed.ports import free_port

    ctx = mp.get_context("spawn")
    reports, release = ctx.Queue(), ctx.Event()
    settings = {"numel": args.numel, "die_after_s": args.die_after_s, "linger_s": args.linger_s,
                "timeout_s": args.timeout_s}  # fmt: skip
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, mode, settings, reports, release)) for r in range(WORLD)]
    for p in procs:
        p.start()
    ranks: dict[int, dict[str, Any]] = {}
    first = 0.0  # when the first survivor reported
    deadline = time.monotonic() + 120 + args.linger_s + args.timeout_s
    while len(ranks) < WORLD - 1 and time.monotonic() < deadline:
        if ranks and not release.is_set() and time.monotonic() - first > args.linger_s:
            release.set()  # one is still blocked: let the failed ones exit, as the agent's restart does
        try:
            rank, report = reports.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ranks:
            first = time.monotonic()
        ranks[rank] = report
    released_in_process = not release.is_set()
    release.set()
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    if len(ranks) < WORLD - 1:
        return {"error": f"only ranks {sorted(ranks)} of the {WORLD - 1} survivors reported", "ranks": ranks}
    return {"ranks": {str(r): ranks[r] for r in sorted(ranks)},
            "last_failed_after_death_s": max(r.get("failed_after_death_s", 0.0) for r in ranks.values()),
            "released_in_process": released_in_process}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "world": WORLD, "numel": args.numel,
                           "die_after_s": args.die_after_s, "linger_s": args.linger_s}  # fmt: skip
    for mode in args.modes:
        out[mode] = _one(mode, args)
    return out
