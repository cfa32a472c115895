"""Application-level WAN emulator for collectives that cross datacenters (one host, CPU/gloo).

What it is for: run a multi-DC job on one machine and see the time the inter-DC links would cost. The real
collective still runs (gloo over loopback), so results are exact; the emulator only decides *when a result
may be used*, sleeping until the emulated completion time. What it must never do: change a result, slow a
group that lies inside one datacenter, or let a result be used earlier than the model below allows.

The link model. One link per ordered DC pair (src → dst), full duplex, ``WanConfig.gbps`` per direction,
shared by every rank of the job on this host: its state (the time it is next free) lives in a tiny file in
``/dev/shm`` (else the temp dir), updated under ``fcntl.flock``, so transfers from different processes queue
FIFO behind each other and concurrent transfers share the bandwidth. Booking ``b`` bytes from time ``t``
occupies the link from ``begin = max(t, free_at)`` for ``b / bytes_per_s``; the data is usable at
``begin + b / bytes_per_s + rounds · one_way_s`` (the α–β model). Chunks in flight together therefore pay the
latency once per round, not once per chunk.

The cost of a collective (:func:`collective_cost`, :func:`p2p_cost`, pure functions) is its latency and
the bytes each rank puts on its outbound inter-DC link(s), for the algorithm the backend really runs
(:mod:`meridian.workers.wan.wire`). Latency is counted in *steps* of that algorithm, and each step of a gloo
collective waits a whole round trip (``wire.ONE_WAYS_PER_STEP`` = 2 one-way delays; measured on the lab):

* RING over a group in rank order, what ``dist.all_reduce`` runs (DDP's flat all-reduce, HAR step 2):
  2(W−1) steps, 2(W−1)/W·S on every edge; each rank whose outgoing edge crosses DCs is charged its edge, so
  a DC-pair direction carries (crossing edges in that direction) × 2(W−1)/W·S. Two ranks: 2 steps, S each.
* RING_GATHER, what ``dist.all_gather`` runs (int8's step 2): W−1 steps, (W−1)·S on every edge.
* EXCHANGE, one rank per DC, a pairwise send/recv: the cheaper of DIRECT (every rank sends its S bytes to
  every other DC, 1 step) and RING. Only for callers that really exchange; ``dist.all_reduce`` is a RING.
  An exchange whose receive was posted ahead (:class:`meridian.workers.wan.exchange.PostedReceives`, HAR's
  chunks from their second step on) waits one one-way delay, as P2P: the announcement went out a step ago.
* P2P: S bytes from sender to receiver, one one-way delay (the receive was announced ahead of the data).

A process group runs at most ``wire.IN_FLIGHT_PER_GROUP`` collectives at once (gloo's worker threads), so
a collective starts on the emulated wire no earlier than the one that many places before it on its group
completed; chunks issued together on one group are therefore booked mostly in sequence, not all at once.

A collective completes at one emulated time for all its ranks: the first rank whose real collective
finishes books every charge of the collective and writes the completion time in a per-group ledger file;
the others read it (matched by a per-group sequence number, which is the same on every rank because ranks
issue collectives on a group in the same order).

When the links are booked: an async all-reduce books them when the real collective completes, from a
done-callback on gloo's ``Work.get_future()`` (gloo completes it on its worker thread; checked with torch
2.13), so handles in flight together pipeline as the model says. gloo's point-to-point ``Work`` has no
future, and a send books its link when it is issued, which is when its bytes would start to leave.

Limits (all conservative or stated): only the sender's outbound direction is charged for each message — the
reverse traffic of a ring or an exchange is symmetric in Meridian and books the reverse link; the emulated
start is when the real collective finished (a send: when it is issued), which over-charges by the loopback
time; one host only (one CLOCK_MONOTONIC, one /dev/shm); no loss, jitter, TCP slow start or window limits
(on the lab a 1 MiB 2-rank all_reduce at 21 ms / 1 Gbit/s took 68 ms against the model's 50 ms); collectives
the loop runs outside the engines (the async loss all-reduce) are not charged.
"""

# No `from __future__ import annotations` here: DDP checks a comm hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor] objects and refuses strings.

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meridian.workers.distributed.layout import DCLayout
from meridian.workers.wan import wire
from meridian.workers.wan.emulator import (
    Algorithm,
    CollectiveCost,
    GroupPlan,
    LinkCharge,
    WanCounter,
    WanEmulator,
    collective_cost,
    p2p_cost,
    sleep_until,
)
from meridian.workers.wan.link import agree_key, cleanup, shm_dir

log = logging.getLogger(__name__)

__all__ = [
    "Algorithm",
    "CollectiveCost",
    "EmulatedWork",
    "FlatHookState",
    "GroupPlan",
    "LinkCharge",
    "WanCounter",
    "WanEmulator",
    "agree_key",
    "all_reduce",
    "all_reduce_future",
    "cleanup",
    "collective_cost",
    "flat_ddp_comm_hook",
    "p2p_cost",
    "recv",
    "send",
    "shm_dir",
    "sleep_until",
]

# ------------------------------------------------------------------------------------------ emulated operations


class _DeadlineTimer:
    """One daemon thread per process that runs callbacks at deadlines (a heap), so emulated futures are
    completed on time without a sleeping thread per operation."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def call_at(self, deadline: float, fn: Callable[[], None]) -> None:
        if deadline <= time.monotonic():
            fn()
            return
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._ids), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="meridian-wan-timer", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # a failing callback must not stop the timer for every other future
                log.exception("WAN emulator timer callback failed")


_TIMER = _DeadlineTimer()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class EmulatedWork:
    """Handle of an async emulated all-reduce: :meth:`wait` returns at max(real, emulated completion).

    The links are booked when the real collective completes (a done-callback on gloo's future, run on a gloo
    thread), so handles in flight together pipeline on the links as the model says."""

    def __init__(
        self, work: dist.Work, emulator: WanEmulator, cost: CollectiveCost, tag: str, seq: int
    ) -> None:
        self._work = work
        self._ready_at: float | None = None
        self._error: BaseException | None = None
        self._booked = threading.Event()

        def on_done(fut: torch.futures.Future) -> None:
            try:
                fut.value()  # raises if the real collective failed; wait() re-raises that
                self._ready_at = emulator.settle(cost, tag=tag, seq=seq, start=time.monotonic())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                self._error = exc
            finally:
                self._booked.set()

        work.get_future().add_done_callback(on_done)

    @property
    def ready_at(self) -> float | None:
        """Emulated completion (``time.monotonic()`` scale), once the real collective has finished."""
        return self._ready_at

    def is_completed(self) -> bool:
        return self._booked.is_set() and self._ready_at is not None and time.monotonic() >= self._ready_at

    def wait(self) -> bool:
        self._work.wait()
        self._booked.wait()
        if self._error is not None:
            raise self._error
        assert self._ready_at is not None
        sleep_until(self._ready_at)
        return True


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    emulator: WanEmulator | None,
    algorithm: Algorithm = Algorithm.EXCHANGE,
    group_ranks: Sequence[int] | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> EmulatedWork | dist.Work | None:
    """``dist.all_reduce`` whose result is usable only when the emulated WAN would have delivered it.

    Returns what ``dist.all_reduce`` returns (None, or a handle with ``wait()``). Without an emulator, or
    on a group inside one DC, this is the plain collective."""
    plan = emulator.plan(group, group_ranks) if emulator is not None and emulator.enabled else None
    if plan is None or not plan.crosses:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    assert emulator is not None
    cost = emulator.cost(algorithm, plan.ranks, _nbytes(tensor))
    emulator.counter.add(_nbytes(tensor), cost.bytes_of(emulator.rank))
    seq = emulator.next_seq(plan.tag)
    if async_op:
        return EmulatedWork(
            dist.all_reduce(tensor, op=op, group=group, async_op=True), emulator, cost, plan.tag, seq
        )
    dist.all_reduce(tensor, op=op, group=group)
    sleep_until(emulator.settle(cost, tag=plan.tag, seq=seq, start=time.monotonic()))
    return None


def all_reduce_future(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    emulator: WanEmulator | None,
    algorithm: Algorithm = Algorithm.EXCHANGE,
    group_ranks: Sequence[int] | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> torch.futures.Future[torch.Tensor]:
    """Async all-reduce of ``tensor`` in place; the future (value: ``tensor``) completes at the emulated
    time, set by the process's timer thread. For DDP comm hooks and other future-chaining callers."""
    plan = emulator.plan(group, group_ranks) if emulator is not None and emulator.enabled else None
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    if plan is None or not plan.crosses:
        return work.get_future().then(lambda fut: fut.value()[0])
    assert emulator is not None
    cost = emulator.cost(algorithm, plan.ranks, _nbytes(tensor))
    emulator.counter.add(_nbytes(tensor), cost.bytes_of(emulator.rank))
    seq = emulator.next_seq(plan.tag)
    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def on_done(fut: torch.futures.Future) -> None:
        try:
            fut.value()
            ready = emulator.settle(cost, tag=plan.tag, seq=seq, start=time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - the caller sees the failure through the future
            out.set_exception(exc)
            return
        _TIMER.call_at(ready, lambda: out.set_result(tensor))

    work.get_future().add_done_callback(on_done)
    return out


@dataclass
class FlatHookState:
    """State of :func:`flat_ddp_comm_hook`: the emulator (None: no emulation), the group, and the count of
    inter-DC bytes this rank's ring edge carried."""

    emulator: WanEmulator | None
    group: dist.ProcessGroup | None = None
    group_ranks: Sequence[int] | None = None
    """The group's ranks in the layout, when that layout is not the world's (one data-parallel group of a
    tensor/pipeline-parallel job)."""
    dc_layout: DCLayout | None = None
    """The datacenter of every rank; the emulator's when None."""
    sent: WanCounter = field(default_factory=WanCounter)
    """What this rank passed to DDP's all-reduces (tensor bytes) and put on inter-DC links (wire bytes)."""
    _ring: tuple[tuple[str, ...], int] | None = field(default=None, repr=False)

    @property
    def layout(self) -> DCLayout:
        if self.dc_layout is not None:
            return self.dc_layout
        assert self.emulator is not None, "FlatHookState needs a layout or an emulator"
        return self.emulator.layout

    @property
    def counter(self) -> WanCounter:
        return self.sent

    def ring(self) -> tuple[tuple[str, ...], int]:
        """The datacenter of every position of the all-reduce ring (group-rank order), and this rank's position."""
        if self._ring is None:
            ranks = self.group_ranks if self.group_ranks is not None else range(self.layout.world_size)
            self._ring = tuple(self.layout.dc_of(r) for r in ranks), dist.get_rank(self.group)
        return self._ring


def flat_ddp_comm_hook(state: FlatHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: DDP's own averaging all-reduce of the bucket, counted (the bytes this rank's ring edge
    puts across a DC boundary, from the bucket actually passed) and, with an emulator, completed when the
    emulated WAN would have delivered a ring all-reduce over the group.

    Register with ``ddp.register_comm_hook(FlatHookState(emulator_or_None, ...), flat_ddp_comm_hook)``."""
    buf = bucket.buffer()
    # Multiply by 1/W rather than divide by W: that is what DDP's reducer does when no hook is registered
    # (reducer.cpp, mul_out with a wrapped 1/div_factor scalar), so gradients equal plain DDP bit for bit
    # for any world size, not only powers of two.
    buf.mul_(1.0 / dist.get_world_size(state.group))
    ring, me = state.ring()
    state.sent.add(_nbytes(buf), wire.ring_all_reduce_sent(ring, me, _nbytes(buf)))
    return all_reduce_future(
        buf, state.group, emulator=state.emulator, algorithm=Algorithm.RING, group_ranks=state.group_ranks
    )


def send(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, *, emulator: WanEmulator | None
) -> None:
    """``dist.send`` to world rank ``dst``; across DCs the sender books its link at issue time and sends the
    arrival time (a float64 tensor) ahead of the data, which :func:`recv` waits for."""
    if (
        emulator is None
        or not emulator.enabled
        or emulator.layout.dc_of(dst) == emulator.layout.dc_of(emulator.rank)
    ):
        dist.send(tensor, dst, group)
        return
    cost = p2p_cost(emulator.rank, dst, emulator.layout, _nbytes(tensor))
    emulator.counter.add(_nbytes(tensor), cost.bytes_of(emulator.rank))
    arrival = emulator.book(cost, time.monotonic())
    dist.send(torch.tensor([arrival], dtype=torch.float64), dst, group)
    dist.send(tensor, dst, group)


def recv(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, *, emulator: WanEmulator | None
) -> None:
    """``dist.recv`` from world rank ``src`` (required: the DC of the sender decides the emulation); across
    DCs it returns at the arrival time the sender booked."""
    if (
        emulator is None
        or not emulator.enabled
        or emulator.layout.dc_of(src) == emulator.layout.dc_of(emulator.rank)
    ):
        dist.recv(tensor, src, group)
        return
    arrival = torch.empty(1, dtype=torch.float64)
    dist.recv(arrival, src, group)
    dist.recv(tensor, src, group)
    sleep_until(float(arrival.item()))
