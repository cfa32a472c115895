"""Membership of an elastic job: who trains in each epoch, decided apart from doing.

Workers join (at start, or as a replacement once capacity returns) and rejoin (after a peer failed, or at
a step boundary when a newcomer waits). The coordinator (the job's runner actor) calls :func:`decide` with
what it knows; the decision says whether a new epoch forms now, with which members in which rank order, or
why everyone must keep waiting. Pure functions: tested without Ray.

Rules:
- A new epoch forms when every live member of the current epoch has rejoined, or when the grace period
  since the first rejoin has passed (a member that does not come back by then is treated as lost). A member
  is not live when Ray reports its node dead or when the liveness judge found it dead and the controller left it
  behind (``gone``: :mod:`meridian.service.runner.liveness.judge`), whichever comes first.
- Ranks are ordered by datacenter (the plan's datacenter order, then any new one), then by node (in the
  order nodes first had a member join), then by join order, so each datacenter's ranks are contiguous and so
  are each node's: a tensor-parallel group, pinned to one node, gets consecutive ranks. A datacenter with no
  member left drops out.
- Below ``min_workers`` the job waits, with a reason, instead of training on too little.
- The first epoch waits for the planned number of workers (up to ``start_timeout_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from meridian.workers.contracts.rendezvous import JoinRequest, runs, spans
from meridian.workers.elastic.protocol import KEEP_SNAPSHOTS


@dataclass(frozen=True)
class Member:
    worker_id: str
    datacenter: str
    node_id: str
    address: str
    """IP reachable by the other workers (rank 0 of an epoch hosts the rendezvous store)."""
    joined_at: float
    last_step: int = 0
    """Optimizer steps this worker has completed (its newest in-memory snapshot)."""
    probe_port: int = 0
    """Its agent's liveness port (:mod:`meridian.service.runner.liveness.probes`); 0: it has none."""
    snapshot_every: int = 1
    """The widest snapshot cadence its epochs agreed so far."""

    @classmethod
    def from_request(cls, request: JoinRequest, *, joined_at: float) -> Member:
        """The member a worker's join makes; ``joined_at``: when the coordinator first saw that worker."""
        return cls(worker_id=request.worker_id, datacenter=request.datacenter, node_id=request.node_id,
                   address=request.address, joined_at=joined_at, last_step=request.last_step,
                   probe_port=request.probe_port, snapshot_every=request.snapshot_every)


@dataclass(frozen=True)
class Epoch:
    number: int
    members: tuple[Member, ...]
    """In rank order."""
    resume_step: int
    """Every member restores its snapshot of this step and trains from here."""
    newcomers: tuple[str, ...] = ()
    """Members without state: they receive it from the others."""
    from_checkpoint: bool = False
    """No member holds the state in memory: everyone loads the latest durable checkpoint."""
    suspend: bool = False
    """The job is being suspended: members restore, write a durable checkpoint and stop."""

    # Read at every member's assignment: each is computed once per epoch (an epoch of N members answers N joins,
    # and a scan of the members per join, or per newcomer of each join, grew as N² or N³).
    @cached_property
    def datacenters(self) -> tuple[str, ...]:
        """Each rank's datacenter, in rank order."""
        return tuple(m.datacenter for m in self.members)

    @cached_property
    def ranks(self) -> dict[str, int]:
        """Worker id → its rank."""
        return {m.worker_id: i for i, m in enumerate(self.members)}

    @cached_property
    def newcomer_ranks(self) -> tuple[int, ...]:
        """The ranks of :attr:`newcomers`."""
        return tuple(self.ranks[w] for w in self.newcomers)

    @cached_property
    def dc_runs(self) -> tuple[tuple[str, int], ...]:
        """:attr:`datacenters` as runs of consecutive ranks (what an assignment carries)."""
        return runs(self.datacenters)

    @cached_property
    def newcomer_spans(self) -> tuple[tuple[int, int], ...]:
        """:attr:`newcomer_ranks` as ranges of consecutive ranks (what an assignment carries)."""
        return spans(self.newcomer_ranks)

    @cached_property
    def ids(self) -> frozenset[str]:
        """The members' worker ids."""
        return frozenset(self.ranks)

    @cached_property
    def on_node(self) -> dict[str, tuple[str, ...]]:
        """Node id → the worker ids of the members on it."""
        out: dict[str, list[str]] = {}
        for m in self.members:
            out.setdefault(m.node_id, []).append(m.worker_id)
        return {n: tuple(ws) for n, ws in out.items()}

    def unreachable(self, alive_nodes: set[str] | frozenset[str], gone: set[str] | frozenset[str]) -> set[str]:
        """The members on a node not in ``alive_nodes`` or in ``gone``: set operations over the nodes and the gone,
        not a scan of the members (called at every join of a re-formation)."""
        out = {w for n in self.on_node.keys() - alive_nodes for w in self.on_node[n]}
        out.update(w for w in gone if w in self.ranks)
        return out

    @cached_property
    def snapshot_every(self) -> int:
        """The widest snapshot cadence any member had agreed."""
        return max(m.snapshot_every for m in self.members)

    def has(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is a member."""
        return worker_id in self.ranks

    def rank_of(self, worker_id: str) -> int:
        return self.ranks[worker_id]


@dataclass(frozen=True)
class Form:
    epoch: Epoch
    lost: tuple[Member, ...] = ()
    """Members of the previous epoch that did not come back."""


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass
class MembershipState:
    """What the coordinator knows; mutated only by the runner, read by :func:`decide`."""

    planned_workers: int
    min_workers: int
    dc_order: tuple[str, ...]
    epoch: Epoch | None = None
    waiting: dict[str, Member] = field(default_factory=dict)
    """Workers blocked in join/rejoin, by worker id."""
    first_join_at: float | None = None
    """When the first worker of the first epoch joined."""
    first_rejoin_at: float | None = None
    """When the first member of the current epoch asked to re-form it."""
    run_workers: int = 0
    """Workers the current Train run started with, when a run replaced one that ended with all its workers (0:
    the plan's): a job that lost every member waits for that many before it re-forms."""

    def newcomers_waiting(self, alive_nodes: set[str] | None = None) -> bool:
        """A worker waits to join (on a node in ``alive_nodes``, when given): members should re-form at their next
        step boundary."""
        new = self.waiting.keys() - self.epoch.ids if self.epoch else self.waiting.keys()  # asked every 0.5 s: no scan
        return any(alive_nodes is None or self.waiting[w].node_id in alive_nodes for w in new)


def _ordered(members: list[Member], dc_order: tuple[str, ...]) -> tuple[Member, ...]:
    order = {dc: i for i, dc in enumerate(dc_order)}
    node_first: dict[str, float] = {}
    for m in members:
        node_first[m.node_id] = min(node_first.get(m.node_id, m.joined_at), m.joined_at)
    return tuple(sorted(members, key=lambda m: (order.get(m.datacenter, len(order)), m.datacenter,
                                                node_first[m.node_id], m.node_id, m.joined_at, m.worker_id)))


def _adopted_resume_step(new: list[Member]) -> int:
    """The step new workers that took over a lost job's snapshot folders resume from: the oldest step among those
    whose folders can still hold the newest one's shards. Each folder keeps its last :data:`KEEP_SNAPSHOTS`
    snapshots, ``snapshot_every`` steps apart, so a folder whose last step is older than that window shares no
    step with the newest: it was left by a worker lost long before (nobody took it over until now), and taking
    its step as everyone's sent the job back to a step no other shard was kept at, so to its durable checkpoint,
    or to step 0 without one. Its worker receives the state like a worker without a folder."""
    held = [m for m in new if m.last_step > 0]
    if not held:
        return 0
    newest = max(m.last_step for m in held)
    window = (KEEP_SNAPSHOTS - 1) * max(m.snapshot_every for m in held)
    return min(m.last_step for m in held if m.last_step >= newest - window)


def decide(state: MembershipState, now: float, *, alive_nodes: set[str], grace_s: float,
           start_timeout_s: float, gone: frozenset[str] | set[str] = frozenset(),
           back: set[str] | None = None) -> Form | Wait | None:
    """``Form`` a new epoch, ``Wait`` (with why), or ``None`` when there is nothing to decide.

    ``alive_nodes``: nodes Ray currently reports alive; a member on a dead node is not waited for, nor is one
    in ``gone`` (worker ids the liveness judge found dead and the controller left behind). ``back``: the waiting
    workers that are members of the current epoch, when the caller keeps them (else found here).
    """
    if not state.waiting:
        return None
    current = state.epoch
    if current is None:
        # Counted before anything is listed: the first epoch's every join asks, and only the last one forms.
        n = len(state.waiting)
        started = now - (state.first_join_at or now)
        if n < state.planned_workers and started < start_timeout_s:
            return Wait(f"{n} of {state.planned_workers} workers have started")
        if n < state.min_workers:
            return Wait(f"only {n} worker(s) started; the job needs at least {state.min_workers}")
        members = _ordered(list(state.waiting.values()), state.dc_order)
        return Form(Epoch(1, members, resume_step=0, newcomers=tuple(m.worker_id for m in members)))

    # Every rejoin of a re-formation asks: the waiting case is set operations (C loops) and the members that
    # cannot be reached (a lost node's), never a Python scan of every member.
    back_ids = back if back is not None else state.waiting.keys() & current.ids
    n_new = len(state.waiting) - len(back_ids)
    unreachable = current.unreachable(alive_nodes, gone)
    if not back_ids:
        if len(unreachable) < len(current.ids):
            # Members are training: they re-form at their next step boundary (newcomers_waiting()).
            return Wait(f"{n_new} new worker(s) wait for the next step boundary")
        # Every member is gone. The state survives only where new workers took over dead members' snapshot folders
        # on their hosts (a Train run restarted on live nodes): resume from the newest step they all hold; the
        # training processes pool those shards and fall back to the durable checkpoint if they do not cover it.
        new = list(state.waiting.values())
        if len(new) < state.min_workers:
            return Wait(
                f"every worker of the job was lost and {len(new)} new worker(s) started; the job needs at least "
                f"{state.min_workers} (topology.min_workers) and waits for capacity to return"
            )
        # As for a first epoch, wait for the workers that are starting (up to start_timeout_s): the first to
        # arrive would otherwise restart alone and hold a part of the shards, too few to rebuild the state.
        expected = state.run_workers or state.planned_workers
        if len(new) < expected and now - min(m.joined_at for m in new) < start_timeout_s:
            return Wait(f"every worker of the job was lost; {len(new)} of {expected} new workers have started")
        members = _ordered(new, state.dc_order)
        return Form(Epoch(current.number + 1, members, resume_step=_adopted_resume_step(new),
                          newcomers=tuple(m.worker_id for m in members),
                          from_checkpoint=not any(m.last_step for m in new)),
                    lost=current.members)
    # Expected: the reachable members and whoever came back; everyone is back when no reachable member is missing.
    back_unreachable = len(unreachable & back_ids)
    n_expected = len(current.ids) - len(unreachable) + back_unreachable
    everyone_back = len(back_ids) >= n_expected
    grace_over = now - (state.first_rejoin_at or now) >= grace_s
    if not everyone_back and not grace_over:
        return Wait(f"{len(back_ids)} of {n_expected} reachable workers are back; waiting up to {grace_s:.0f} s for the rest")
    waiting = list(state.waiting.values())
    returned = [m for m in waiting if m.worker_id in back_ids]
    lost = tuple(m for m in current.members if m.worker_id not in back_ids)
    # A new worker on a node Ray reports dead, or known gone, is not taken in with the members (they would wait on
    # it to form the group, until the abort); one on a node too new for the last report is taken in at the next.
    new = [m for m in waiting if m.worker_id not in back_ids and m.node_id in alive_nodes and m.worker_id not in gone]
    survivors = returned + new
    if len(survivors) < state.min_workers:
        return Wait(
            f"{len(survivors)} worker(s) left after losing {len(lost)}; the job needs at least "
            f"{state.min_workers} (topology.min_workers) and waits for capacity to return"
        )
    # A member that holds no state at the current epoch's step (a newcomer of it whose epoch broke before it
    # restored, so before it kept a snapshot; or one whose folder is stale) is a newcomer again: it receives the
    # state. Taking its step as everyone's sent the whole job back to step 0 and discarded the others' snapshots.
    holders = [m for m in returned if m.last_step >= current.resume_step]
    resume = min(m.last_step for m in holders or returned)
    empty = [m for m in returned if m.last_step < current.resume_step] if holders else []
    members = _ordered(survivors, state.dc_order)
    newcomers = tuple(m.worker_id for m in new + empty)
    return Form(Epoch(current.number + 1, members, resume_step=resume, newcomers=newcomers), lost)
