"""Simulated ranks for ``meridian bench scale``: one process hosts the ranks of some simulated nodes.

Each rank is an asyncio task that speaks the workers' protocol to the job's runner actor, with the workers'
messages: it joins (:class:`~meridian.workers.contracts.rendezvous.JoinRequest` through ``rdzv_join``, again on
every :class:`Waiting`), and once assigned it "trains" one step every ``--step-s``: a ``done`` and a ``computed``
heartbeat per step (the fields of :func:`meridian.workers.loop.observe.heartbeat`), rank 0's
:class:`~meridian.workers.contracts.records.StepRecord` through ``push_progress`` and its ``rdzv_pending_change``
question every 0.5 s, as :class:`~meridian.workers.elastic.trainer.PendingChangeWatch` asks. Heartbeats leave in
batches every ``--beats-every-s`` (``0``: as often as the workers batch in an epoch of that size,
:func:`~meridian.workers.elastic.protocol.beats_every_s`): one ``push_heartbeats`` call per rank (``--beats-per rank``,
what a worker's agent does) or one per node with its ranks' beats (``--beats-per node``). No model, no collectives.

Commands on stdin, one a line: ``go`` (start joining), ``lose NODE`` (NODE's ranks stop calling; every other rank's
epoch breaks, as its collectives would, and it rejoins), ``quit``. On stdout, JSON lines: ``{"ready": ...}`` once
connected, then ``{"epoch": E, "ranks": n, "last_at": t}`` when every live rank of this process holds an
assignment in epoch ``E`` (``t``: when the last one got it, wall clock), and ``{"error": ...}`` if a call failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from typing import Any

PENDING_CHANGE_EVERY_S = 0.5


class Ranks:
    def __init__(self, runner: Any, nodes: list[tuple[str, str]], ranks_per_node: int, args: argparse.Namespace) -> None:
        self.runner, self.args = runner, args
        self.ranks = [(f"{node}-r{i}", node, dc) for node, dc in nodes for i in range(ranks_per_node)]
        self.lost: set[str] = set()
        self.broken = asyncio.Event()  # set (and replaced) when an epoch breaks
        self.assigned: dict[str, tuple[int, float, int]] = {}  # worker id → (epoch, when, world size)
        self.reported: set[int] = set()
        self.beats: dict[str, list[dict[str, Any]]] = {}  # batch key (rank's worker id or node) → beats
        self.tasks: dict[str, asyncio.Task] = {}
        self.every_s = args.beats_every_s or 0.25  # until an epoch's size is known

    def say(self, **fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    def _check_epoch(self) -> None:
        live = [w for w, node, _ in self.ranks if node not in self.lost]
        epochs = {self.assigned.get(w, (0, 0.0, 0))[0] for w in live}
        if len(epochs) == 1 and (e := epochs.pop()) > 0 and e not in self.reported:
            self.reported.add(e)
            self.say(epoch=e, ranks=len(live), last_at=max(self.assigned[w][1] for w in live),
                     world_size=self.assigned[live[0]][2])

    async def rank(self, worker_id: str, node: str, dc: str, port: int) -> None:
        from meridian.workers.contracts.records import StepRecord
        from meridian.workers.contracts.rendezvous import Finished, JoinRequest, Waiting

        epoch, step = 0, 0
        while True:
            request = JoinRequest(worker_id=worker_id, datacenter=dc, node_id=node, address="127.0.0.1", port=port,
                                  last_step=step)
            reply = await self.runner.rdzv_join.remote(request, epoch)
            if isinstance(reply, Finished):
                return
            if isinstance(reply, Waiting):
                if getattr(reply, "retry_after_s", 0.0):
                    await asyncio.sleep(reply.retry_after_s)
                continue
            epoch, step, rank = reply.epoch, reply.resume_step, reply.rank
            broken = self.broken
            self.assigned[worker_id] = (epoch, time.time(), reply.world_size)
            if not self.args.beats_every_s:
                from meridian.workers.elastic.protocol import beats_every_s

                self.every_s = beats_every_s(reply.world_size)
            self._check_epoch()
            key = node if self.args.beats_per == "node" else worker_id
            asked_at = time.monotonic()
            while not broken.is_set():
                started = time.time()
                try:
                    await asyncio.wait_for(broken.wait(), timeout=self.args.step_s)
                    break
                except asyncio.TimeoutError:
                    pass
                step += 1
                now = time.time()
                self.beats.setdefault(key, []).extend((
                    {"rank": rank, "phase": "computed", "step": step, "time": now},
                    {"rank": rank, "phase": "done", "step": step, "step_s": now - started, "data_s": 0.0,
                     "compute_s": now - started, "sync_wait_s": 0.0, "time": now}))
                if rank == 0:
                    self.runner.push_progress.remote([StepRecord(
                        step=step, total_steps=10**9, loss=1.0, lr=1e-3, step_s=now - started, tokens_per_s=0.0,
                        grad_norm=1.0, inter_dc_bytes=0, time=now, workers=reply.world_size, epoch=epoch)])
                    if time.monotonic() - asked_at >= PENDING_CHANGE_EVERY_S:
                        asked_at = time.monotonic()
                        await self.runner.rdzv_pending_change.remote(epoch)

    async def send_beats(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            batches, self.beats = self.beats, {}
            for beats in batches.values():
                self.runner.push_heartbeats.remote(beats)

    def start(self) -> None:
        for i, (w, node, dc) in enumerate(self.ranks):
            self.tasks[w] = asyncio.ensure_future(self._guard(self.rank(w, node, dc, 20000 + i)))
        self.tasks["beats"] = asyncio.ensure_future(self._guard(self.send_beats()))

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - said on stdout: the bench reports it
            self.say(error=f"{type(e).__name__}: {e}")

    def lose(self, node: str) -> None:
        self.lost.add(node)
        for w, n, _ in self.ranks:
            if n == node:
                self.tasks[w].cancel()
        old, self.broken = self.broken, asyncio.Event()
        old.set()


async def amain(args: argparse.Namespace) -> None:
    import ray

    ray.init(address=args.ray_address, namespace=args.namespace, log_to_driver=False)
    runner = ray.get_actor(args.runner, namespace=args.namespace)
    nodes = [tuple(x.split("@")) for x in args.nodes.split(",")]
    ranks = Ranks(runner, nodes, args.ranks_per_node, args)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str] = asyncio.Queue()
    threading.Thread(target=lambda: [loop.call_soon_threadsafe(lines.put_nowait, ln.strip()) for ln in sys.stdin]
                     + [loop.call_soon_threadsafe(lines.put_nowait, "quit")], daemon=True).start()
    ranks.say(ready=len(ranks.ranks))
    while True:
        line = await lines.get()
        if line == "go":
            ranks.start()
        elif line.startswith("lose "):
            ranks.lose(line.split()[1])
        elif line == "quit":
            break
    for t in ranks.tasks.values():
        t.cancel()
    ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meridian.bench.scale_ranks")
    p.add_argument("--ray-address", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--runner", required=True, help="the job runner actor's name")
    p.add_argument("--nodes", required=True, help="NODE@DC,... the simulated nodes this process hosts")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--beats-every-s", type=float, default=0.0)
    p.add_argument("--beats-per", choices=("rank", "node"), default="rank")
    asyncio.run(amain(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
