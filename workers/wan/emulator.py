"""The WAN emulator's model: what a collective costs on the inter-DC links, and the emulator that books it.

What it is for: pure cost functions (tested without processes) and :class:`WanEmulator`, which turns a cost
into an emulated completion time on the links shared through :mod:`meridian.workers.wan.link`. The model and
its limits are described in :mod:`meridian.workers.wan.collectives`, which holds the operations built on it. What it
must never do: report a completion earlier than the model allows, or charge a group inside one datacenter.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from meridian.workers.contracts.config import WanConfig
from meridian.workers.distributed.layout import DCLayout
from meridian.workers.wan import wire
from meridian.workers.wan.link import FILE_PREFIX, KEY_RE, Ledger, SharedLink, safe_name, shm_dir

# ----------------------------------------------------------------------------------------------- cost model


class Algorithm(str, enum.Enum):
    """How a collective crosses datacenters (see the module docstring for the cost of each)."""

    EXCHANGE = "exchange"  # one rank per DC: the cheaper of DIRECT and RING
    DIRECT = "direct"  # every rank sends its tensor to every other DC, one round
    RING = "ring"  # the group's ranks in rank order form a ring, as DDP / gloo all-reduce
    RING_GATHER = "ring_gather"  # a ring all-gather, as gloo's all_gather: (W-1) rounds, (W-1)·S per edge
    P2P = "p2p"  # one send


@dataclass(frozen=True)
class LinkCharge:
    """``wire_bytes`` that ``rank`` puts on the link ``src_dc → dst_dc``."""

    rank: int
    src_dc: str
    dst_dc: str
    wire_bytes: float


@dataclass(frozen=True)
class CollectiveCost:
    """Latency and per-rank outbound link charges of one collective."""

    algorithm: Algorithm
    rounds: int
    """One-way latencies on the collective's critical path: steps × :data:`wire.ONE_WAYS_PER_STEP`."""
    charges: tuple[LinkCharge, ...]

    @property
    def crosses(self) -> bool:
        return bool(self.charges)

    def bytes_of(self, rank: int) -> float:
        """Wire bytes ``rank`` puts on its outbound inter-DC links."""
        return sum(c.wire_bytes for c in self.charges if c.rank == rank)

    def link_bytes(self) -> dict[tuple[str, str], float]:
        """Wire bytes per DC-pair direction, summed over ranks."""
        out: dict[tuple[str, str], float] = {}
        for c in self.charges:
            out[c.src_dc, c.dst_dc] = out.get((c.src_dc, c.dst_dc), 0.0) + c.wire_bytes
        return out

    def isolated_s(self, wan: WanConfig) -> float:
        """Completion time on idle links: the busiest direction's bytes / bandwidth + rounds · one way."""
        if not self.charges:
            return 0.0
        return max(self.link_bytes().values()) / wan.bytes_per_s + self.rounds * wan.one_way_s


def _ring(ranks: Sequence[int], layout: DCLayout, nbytes: float, *, gather: bool = False) -> CollectiveCost:
    w = len(ranks)
    per_edge = wire.ring_all_gather_edge(w, nbytes) if gather else wire.ring_all_reduce_edge(w, nbytes)
    charges = []
    for i, r in enumerate(ranks):
        nxt = ranks[(i + 1) % w]
        if layout.dc_of(r) != layout.dc_of(nxt):
            charges.append(LinkCharge(r, layout.dc_of(r), layout.dc_of(nxt), per_edge))
    rounds = wire.ring_steps(w, gather=gather) * wire.ONE_WAYS_PER_STEP
    return CollectiveCost(Algorithm.RING_GATHER if gather else Algorithm.RING, rounds, tuple(charges))


def _direct(ranks: Sequence[int], layout: DCLayout, nbytes: float) -> CollectiveCost:
    charges = tuple(
        LinkCharge(r, layout.dc_of(r), layout.dc_of(p), float(nbytes)) for r in ranks for p in ranks if p != r
    )
    return CollectiveCost(Algorithm.DIRECT, wire.ONE_WAYS_PER_STEP, charges)


def collective_cost(
    algorithm: Algorithm,
    group_ranks: Sequence[int],
    layout: DCLayout,
    nbytes: float,
    wan: WanConfig | None = None,
) -> CollectiveCost:
    """Cost of an all-reduce of ``nbytes`` per rank over ``group_ranks`` (world ranks, any order).

    A group inside one DC costs nothing. EXCHANGE and DIRECT need one rank per DC; EXCHANGE with more than
    two DCs compares the options on ``wan``'s figures."""
    ranks = tuple(sorted(group_ranks))
    dcs = [layout.dc_of(r) for r in ranks]
    if len(set(dcs)) <= 1:
        return CollectiveCost(algorithm, 0, ())
    if algorithm in (Algorithm.RING, Algorithm.RING_GATHER):
        return _ring(ranks, layout, nbytes, gather=algorithm is Algorithm.RING_GATHER)
    if algorithm not in (Algorithm.EXCHANGE, Algorithm.DIRECT):
        raise ValueError(f"collective_cost takes RING, RING_GATHER, EXCHANGE or DIRECT, got {algorithm}; use p2p_cost")
    if len(set(dcs)) != len(dcs):
        raise ValueError(f"{algorithm.value} needs one rank per datacenter, got ranks {ranks} in {dcs}")
    direct = _direct(ranks, layout, nbytes)
    if algorithm is Algorithm.DIRECT or len(ranks) == 2:
        return direct
    if wan is None:
        raise ValueError("EXCHANGE over more than two datacenters needs the WanConfig to pick ring or direct")
    return min((direct, _ring(ranks, layout, nbytes)), key=lambda c: c.isolated_s(wan))


def p2p_cost(src: int, dst: int, layout: DCLayout, nbytes: float) -> CollectiveCost:
    """Cost of sending ``nbytes`` from world rank ``src`` to ``dst``: one one-way delay, nothing inside a DC.

    One way, not a step's round trip: gloo's receiver announces its posted receive ahead of the data, and a
    receive posted before the send (a pipeline stage waiting for activations) has announced itself already."""
    if layout.dc_of(src) == layout.dc_of(dst):
        return CollectiveCost(Algorithm.P2P, 0, ())
    charge = LinkCharge(src, layout.dc_of(src), layout.dc_of(dst), float(nbytes))
    return CollectiveCost(Algorithm.P2P, 1, (charge,))


# ------------------------------------------------------------------------------------------------- emulator


@dataclass
class WanCounter:
    """What this rank put into inter-DC operations; read and reset per step."""

    tensor_bytes: int = 0
    """Bytes of the tensors this rank passed to inter-DC collectives and sends."""
    wire_bytes: float = 0.0
    """Bytes the model charged to this rank's outbound inter-DC links."""
    ops: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, tensor_bytes: int, wire_bytes: float) -> None:
        with self._lock:
            self.tensor_bytes += tensor_bytes
            self.wire_bytes += wire_bytes
            self.ops += 1

    def reset(self) -> WanCounter:
        """Zero the counter; return what it held."""
        with self._lock:
            snap = WanCounter(self.tensor_bytes, self.wire_bytes, self.ops)
            self.tensor_bytes, self.wire_bytes, self.ops = 0, 0.0, 0
        return snap


@dataclass(frozen=True)
class GroupPlan:
    """What the emulator needs to know about one process group, computed once."""

    ranks: tuple[int, ...]
    tag: str  # names the group's ledger file; equal on every rank
    crosses: bool


class WanEmulator:
    """The emulated links as seen from one rank. Disabled (every op is the plain one) when ``wan`` is None
    or the layout has a single datacenter.

    ``key`` namespaces the shared files of one run (see :func:`agree_key`, :func:`cleanup`)."""

    def __init__(
        self,
        wan: WanConfig | None,
        layout: DCLayout,
        rank: int,
        *,
        key: str,
        counter: WanCounter | None = None,
        directory: str | None = None,
    ) -> None:
        if not KEY_RE.fullmatch(key):
            raise ValueError(f"wan key must be 1-64 characters of [A-Za-z0-9_.-], got {key!r}")
        self.wan = wan
        self.layout = layout
        self.rank = rank
        self.key = key
        self.counter = counter if counter is not None else WanCounter()
        self.directory = directory or shm_dir()
        self.enabled = wan is not None and layout.num_dcs > 1
        self._links: dict[tuple[str, str], SharedLink] = {}
        self._ledgers: dict[str, Ledger] = {}
        self._seqs: dict[str, Iterator[int]] = {}
        self._plans: dict[object, tuple[dist.ProcessGroup | None, GroupPlan]] = {}
        self._open_lock = threading.Lock()  # files are opened lazily, possibly from gloo callback threads

    def _path(self, *parts: str) -> str:
        return os.path.join(self.directory, FILE_PREFIX + "+".join((self.key, *map(safe_name, parts))))

    def link(self, src_dc: str, dst_dc: str) -> SharedLink:
        with self._open_lock:
            if (src_dc, dst_dc) not in self._links:
                assert self.wan is not None
                self._links[src_dc, dst_dc] = SharedLink(
                    self._path("link", src_dc, dst_dc), self.wan.bytes_per_s
                )
            return self._links[src_dc, dst_dc]

    def plan(self, group: dist.ProcessGroup | None, group_ranks: Sequence[int] | None = None) -> GroupPlan:
        """The ranks, ledger tag and crossing flag of ``group`` (cached per group object)."""
        cache_key = id(group) if group_ranks is None else (id(group), tuple(group_ranks))
        cached = self._plans.get(cache_key)
        if cached is None:
            g = group if group is not None else dist.group.WORLD
            ranks = tuple(sorted(group_ranks if group_ranks is not None else dist.get_process_group_ranks(g)))
            digest = hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
            # group_name is the same on every rank (groups are created in the same order everywhere); None and
            # WORLD get the same tag, hence one sequence of collectives.
            tag = f"g{getattr(g, 'group_name', '')}-{digest}"
            crosses = len({self.layout.dc_of(r) for r in ranks}) > 1
            # The group object is kept alive with its plan so that its id() is never reused by another group.
            cached = self._plans[cache_key] = (group, GroupPlan(ranks, tag, self.enabled and crosses))
        return cached[1]

    def next_seq(self, tag: str) -> int:
        """Sequence number of the next collective on the group ``tag``; call in issue order."""
        return next(self._seqs.setdefault(tag, itertools.count()))

    def book(self, cost: CollectiveCost, start: float) -> float:
        """Book every charge of ``cost`` from ``start``; return when its result is usable.

        One booking per DC-pair direction: charges of one collective on the same link are in flight
        together, so they serialise on its bandwidth and share one set of latency rounds."""
        if not cost.charges:
            return start
        assert self.wan is not None
        end = max(self.link(src, dst).reserve(b, start) for (src, dst), b in cost.link_bytes().items())
        return end + cost.rounds * self.wan.one_way_s

    def settle(
        self, cost: CollectiveCost, *, tag: str, seq: int, start: float, in_flight: int = wire.IN_FLIGHT_PER_GROUP
    ) -> float:
        """Completion time of collective ``seq`` on group ``tag``: booked by the first rank to call this,
        read by the others, so all ranks of one collective finish together."""
        ledger = self._ledger(tag)
        # A group runs at most IN_FLIGHT_PER_GROUP collectives at once (gloo's worker threads): the next one
        # goes on the wire when one of those has completed, not alongside all of them.
        return ledger.settle(seq, start, lambda s: self.book(cost, s), in_flight=in_flight)

    def _ledger(self, tag: str) -> Ledger:
        with self._open_lock:
            ledger = self._ledgers.get(tag)
            if ledger is None:
                ledger = self._ledgers[tag] = Ledger(self._path("ledger", tag))
            return ledger

    def book_outbound(self, cost: CollectiveCost, *, tag: str, seq: int, start: float) -> None:
        """A point-to-point exchange whose receives were announced ahead: book this rank's outbound charges of
        collective ``seq`` from ``start`` (when it sent) and record when they leave, for its peers. Call before
        the real send, so the record exists by the time the data can arrive."""
        mine = [c for c in cost.charges if c.rank == self.rank]
        end = max((self.link(c.src_dc, c.dst_dc).reserve(c.wire_bytes, start) for c in mine), default=start)
        self._ledger(f"{tag}>{self.rank}").settle(seq, start, lambda _: end)

    def settle_outbound(self, cost: CollectiveCost, *, tag: str, seq: int) -> float:
        """Completion of an exchange booked with :meth:`book_outbound` by every sender: when the last sender's
        bytes have left, plus the latency rounds. Call once the real transfers are done (every record exists)."""
        assert self.wan is not None
        ends = [self._ledger(f"{tag}>{r}").recorded(seq) for r in sorted({c.rank for c in cost.charges})]
        left = max((e for e in ends if e is not None), default=time.monotonic())
        return left + cost.rounds * self.wan.one_way_s

    def cost(self, algorithm: Algorithm, group_ranks: Sequence[int], nbytes: float) -> CollectiveCost:
        return collective_cost(algorithm, group_ranks, self.layout, nbytes, self.wan)

    def close(self) -> None:
        """Close this rank's file handles (the files stay for the other ranks; see :func:`cleanup`)."""
        with self._open_lock:
            for f in (*self._links.values(), *self._ledgers.values()):
                f.close()
            self._links.clear()
            self._ledgers.clear()


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.monotonic() >= deadline``; never returns early."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)
