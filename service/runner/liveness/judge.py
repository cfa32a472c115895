"""The one place that decides whether a rank is alive, dead, stuck or slow, and why.

:func:`judge` takes what is known about every worker of a job at one moment (:class:`Seen`: Ray's view of its
node, the last answer of its agent's liveness port, whether it is back in the rendezvous, its last heartbeats)
and returns one :class:`Verdict` per worker, with the :class:`Cause` code branches on and the reason a person
reads. Pure: no Ray, no sockets, no clock (the caller passes the times); tested against tables of observations
(tests/test_liveness_judge.py). It must never act: the controller turns verdicts into actions
(:func:`~meridian.service.runner.controller.decide.liveness_actions`) and the coordinator carries them out.

The rules, first match wins:

- **dead**: Ray reports the worker's node dead; or its liveness port refused a connection (the kernel of a live
  host answers for a process that is gone); or its host did not answer :attr:`LivenessPolicy.unreachable_times`
  probes in a row. A dead member is not waited for: the epoch re-forms without it.
- **alive**: it is back in the rendezvous (it calls, so its process lives).
- **stuck** (the coordinator stops its training process; the next one rejoins from the snapshots):
  its peers rejoined at least :attr:`~LivenessPolicy.abort_after_s` ago and it answers but has not
  (``not_rejoined``: in a collective, or a group formation, with a peer that left); or a member's node is dead,
  nobody rejoined for :attr:`~LivenessPolicy.stranded_after_s` (``stranded``: its collectives wait on a host that
  closes nothing); or newcomers waited :attr:`~LivenessPolicy.newcomers_abort_after_s` for a step boundary that
  never came (``no_step_boundary``).
- **stuck** (named once as a ``stall`` event): while it trains, its last heartbeat is older than
  ``stall_factor`` × the median recent step time (never under ``stall_floor_s``), and it computed fewer steps than
  the most advanced rank (the others sit in the gradient sync waiting for it); when every silent rank is equally
  far, all are named (the collective itself hangs: a link, not a rank).
- **slow** (named once per epoch as a ``rank_slow`` event): its median compute time per step over its recent
  heartbeats is over ``slow_factor`` × the median of the other ranks' (the others wait for it in every sync).
- otherwise **alive**.

Nothing is judged stuck or slow from heartbeats while the membership waits or after the last step (``idle``):
ranks are idle by design then.
"""

from __future__ import annotations

import bisect
import enum
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from meridian.workers.contracts.events import StallSeen


class Probe(str, enum.Enum):
    """What a connection to a worker's liveness port found."""

    ALIVE = "alive"
    GONE = "gone"  # connection refused: nothing listens there any more
    UNREACHABLE = "unreachable"  # no answer within the timeout (host down, or a partition)


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    STUCK = "stuck"
    SLOW = "slow"


class Cause(str, enum.Enum):
    """Why a verdict is what it is: what the controller branches on."""

    REJOINED = "rejoined"
    TRAINING = "training"
    NODE_DEAD = "node_dead"
    PROCESS_GONE = "process_gone"
    HOST_UNREACHABLE = "host_unreachable"
    NOT_REJOINED = "not_rejoined"
    STRANDED = "stranded"
    NO_STEP_BOUNDARY = "no_step_boundary"
    SILENT = "silent"
    SLOW_STEPS = "slow_steps"

    @property
    def stops_the_process(self) -> bool:
        """A stuck member whose training process the coordinator stops (the others are named only)."""
        return self in (Cause.NOT_REJOINED, Cause.STRANDED, Cause.NO_STEP_BOUNDARY)


@dataclass(frozen=True, kw_only=True)
class LivenessPolicy:
    unreachable_times: int = 2
    """A worker whose host did not answer this many probes in a row is dead."""
    abort_after_s: float = 10.0
    """A member that answers but has not rejoined this long after its peers first did is stuck."""
    stranded_after_s: float = 1.0
    """A member's node is dead and nobody rejoined for this long: the others are stranded with it. A killed
    process's sockets close and its peers' collectives fail within milliseconds, long before Ray's health check
    (3 s at the fastest); a host that lost its power or its network closes nothing, and its peers would wait out
    the collective timeout."""
    newcomers_abort_after_s: float = 60.0
    """Newcomers that waited this long for the members' next step boundary while the members answer: the members
    are stuck (no step boundary for a minute)."""
    stall_factor: float = 5.0
    """A training rank is stuck after this many median step times without finishing a step..."""
    stall_floor_s: float = 5.0
    """...and never before this many seconds (tiny steps make N x median meaninglessly short)."""
    slow_factor: float = 2.0
    """A rank whose median compute time per step is over this many times the other ranks' median is slow."""
    slow_min_s: float = 0.05
    """...and over theirs by at least this many seconds (jitter of millisecond steps is not slowness)."""
    slow_min_beats: int = 3
    """Heartbeats a rank needs before it is judged slow (a first step builds caches and compiles)."""

    def __post_init__(self) -> None:
        if self.unreachable_times < 1:
            raise ValueError(f"unreachable_times must be >= 1, got {self.unreachable_times}")
        for name in ("abort_after_s", "stranded_after_s", "newcomers_abort_after_s", "stall_floor_s", "slow_min_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.stall_factor <= 1:
            raise ValueError(f"stall_factor must be > 1, got {self.stall_factor}")
        if self.slow_factor <= 1:
            raise ValueError(f"slow_factor must be > 1, got {self.slow_factor}")
        if self.slow_min_beats < 1:
            raise ValueError(f"slow_min_beats must be >= 1, got {self.slow_min_beats}")

    def stall_after_s(self, median_step_s: float) -> float:
        """How long a rank may go without finishing a step, at a median step time of ``median_step_s``."""
        return max(self.stall_floor_s, self.stall_factor * median_step_s)


@dataclass(frozen=True, kw_only=True)
class Beat:
    """A rank's last heartbeats, as the runner stamped them on arrival."""

    step: int
    """Steps it finished."""
    computed: int
    """Steps whose forward and backward it computed (a rank blocked in the sync has computed one more)."""
    at: float
    """When it last said anything (the runner's wall clock, the one :attr:`Seen.beats_at` is on)."""
    compute_s: tuple[float, ...] = ()
    """Its recent steps' compute times, oldest first."""


@dataclass(frozen=True, kw_only=True)
class RankSeen:
    """What is known about one worker of the job now."""

    worker_id: str
    rank: int | None
    """Its rank in the current epoch; ``None``: a worker waiting to join, not a member."""
    node_id: str
    datacenter: str
    node_alive: bool = True
    """Ray reports its node alive."""
    probe_port: int = 0
    """Its agent's liveness port; 0: it has none (it is never probed, and cannot be told to stop)."""
    probe: Probe | None = None
    """The last answer of its port since it last called (``None``: not probed since)."""
    misses: int = 0
    """Probes in a row that got no answer."""
    rejoined: bool = False
    """It is back in the rendezvous: it calls."""
    beat: Beat | None = None


@dataclass(frozen=True, kw_only=True)
class Seen:
    """Every worker of a job at one moment, and where its membership is."""

    now: float
    """The coordinator's clock (monotonic), the one the ``*_since`` times are on."""
    epoch: int
    """The current epoch (0: none formed yet)."""
    ranks: tuple[RankSeen, ...]
    reform_since: float | None = None
    """When the first member asked to re-form the current epoch (``None``: nobody did)."""
    node_dead_since: float | None = None
    """When Ray first reported a member's node dead in this epoch (``None``: every member's node lives)."""
    newcomers_since: float | None = None
    """When the oldest newcomer (a worker that is no member) started waiting for a step boundary."""
    idle: bool = False
    """Ranks are idle by design (the membership waits, or the last step is done): no heartbeat verdicts."""
    finished: bool = False
    """A member trained the job's last step: nobody is stranded any more."""
    beats_at: float = 0.0
    """When the heartbeats were read (the runner's wall clock)."""
    recent_step_s: tuple[float, ...] = ()
    """Recent step times of every rank (the stall threshold's median)."""


@dataclass(frozen=True, kw_only=True)
class Verdict:
    worker_id: str
    rank: int | None
    node_id: str
    datacenter: str
    epoch: int
    liveness: Liveness
    cause: Cause
    reason: str
    """What a person reads (never what code branches on: that is :attr:`cause`)."""
    probe_port: int = 0
    step: int = 0
    """Steps it finished when judged (heartbeat verdicts)."""
    stall: StallSeen | None = None
    """A ``silent`` verdict's figures, as the ``stall`` event carries them."""
    compute_s: float = 0.0
    """A ``slow`` verdict: its median compute time per step..."""
    peers_compute_s: float = 0.0
    """...and the other ranks' median."""

    @property
    def where(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "the waiting worker"
        return f"{who} in {self.datacenter} on node {self.node_id[:12]}"


def judge(seen: Seen, policy: LivenessPolicy = LivenessPolicy()) -> tuple[Verdict, ...]:
    """One verdict per worker of ``seen``, in its order (see the module docstring for the rules)."""
    heartbeat = {} if seen.idle else _heartbeat_verdicts(seen, policy)
    members = [r for r in seen.ranks if r.rank is not None]
    stranded = (seen.node_dead_since is not None and seen.reform_since is None and not seen.finished
                and seen.now - seen.node_dead_since >= policy.stranded_after_s)
    dead_nodes = ", ".join(sorted({f"node {r.node_id[:12]} in {r.datacenter}" for r in members if not r.node_alive}))
    since = seen.now - seen.reform_since if seen.reform_since is not None else None
    waited = seen.now - seen.newcomers_since if seen.newcomers_since is not None else 0.0
    out = []
    for r in seen.ranks:
        def verdict(liveness: Liveness, cause: Cause, reason: str, **more: object) -> Verdict:
            return Verdict(worker_id=r.worker_id, rank=r.rank, node_id=r.node_id, datacenter=r.datacenter,  # noqa: B023
                           epoch=seen.epoch, liveness=liveness, cause=cause, reason=reason,
                           probe_port=r.probe_port, **more)  # noqa: B023 - called in this iteration only

        if not r.node_alive:
            out.append(verdict(Liveness.DEAD, Cause.NODE_DEAD, "Ray reports its node dead"))
        elif r.probe is Probe.GONE:
            out.append(verdict(Liveness.DEAD, Cause.PROCESS_GONE,
                               "its process no longer answers (its liveness port refused a connection)"))
        elif r.misses >= policy.unreachable_times:
            out.append(verdict(Liveness.DEAD, Cause.HOST_UNREACHABLE,
                               f"its host did not answer {r.misses} probes in a row"))
        elif r.rejoined or r.rank is None:
            out.append(verdict(Liveness.ALIVE, Cause.REJOINED, "it calls the rendezvous"))
        elif r.probe_port and since is not None and since >= policy.abort_after_s:
            out.append(verdict(Liveness.STUCK, Cause.NOT_REJOINED,
                               f"answers but had not rejoined {since:.0f} s after its peers (stuck in a collective "
                               "with a peer that left)"))
        elif r.probe_port and waited >= policy.newcomers_abort_after_s:
            out.append(verdict(Liveness.STUCK, Cause.NO_STEP_BOUNDARY,
                               f"answers but had reached no step boundary while new workers waited {waited:.0f} s "
                               "(stuck)"))
        elif r.probe_port and stranded:
            out.append(verdict(Liveness.STUCK, Cause.STRANDED,
                               f"had not left epoch {seen.epoch} {policy.stranded_after_s:.0f} s after Ray reported "
                               f"{dead_nodes} dead (its collectives wait on a host that closes nothing: power or "
                               "network lost)"))
        elif r.rank in heartbeat:
            liveness, cause, reason, more = heartbeat[r.rank]
            out.append(verdict(liveness, cause, reason, **more))
        else:
            out.append(verdict(Liveness.ALIVE, Cause.TRAINING, "it trains"))
    return tuple(out)


def _heartbeat_verdicts(seen: Seen, policy: LivenessPolicy) -> dict[int, tuple]:
    """rank → (liveness, cause, reason, fields) of the members whose heartbeats say stuck or slow."""
    beats = {r.rank: (r, r.beat) for r in seen.ranks if r.rank is not None and r.beat is not None}
    if not beats or not seen.recent_step_s:
        return {}
    median = statistics.median(seen.recent_step_s)
    threshold = policy.stall_after_s(median)
    silent = [k for k in sorted(beats) if seen.beats_at - beats[k][1].at > threshold]
    ahead = max(b.computed for _, b in beats.values())
    behind = [k for k in silent if beats[k][1].computed < ahead]
    out: dict[int, tuple] = {}
    for k in behind or silent:
        r, b = beats[k]
        stall = StallSeen(rank=k, step=b.step, silent_s=seen.beats_at - b.at, threshold_s=threshold,
                          median_step_s=median, node_id=r.node_id, datacenter=r.datacenter)
        out[k] = (Liveness.STUCK, Cause.SILENT, stall_reason(stall), {"step": b.step, "stall": stall})
    medians = {k: statistics.median(b.compute_s) for k, (_, b) in beats.items()
               if len(b.compute_s) >= policy.slow_min_beats}  # fmt: skip
    ordered = sorted(medians.values())
    for k, mine in medians.items():
        if k in out or len(ordered) < 2:
            continue
        peers = _median_without(ordered, bisect.bisect_left(ordered, mine))
        if mine > policy.slow_factor * peers and mine - peers >= policy.slow_min_s:
            out[k] = (Liveness.SLOW, Cause.SLOW_STEPS,
                      f"computes a step in {mine:.2f} s, {mine / max(peers, 1e-9):.1f}x the other ranks' median "
                      f"({peers:.2f} s): they wait for it in every sync",
                      {"step": beats[k][1].step, "compute_s": mine, "peers_compute_s": peers})
    return out


def _median_without(ordered: list[float], i: int) -> float:
    """The median of sorted ``ordered`` without its element ``i`` (every rank against the others: linear, not
    quadratic, in the ranks of a large job)."""
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j if j < i else j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def stall_reason(s: StallSeen) -> str:
    return (f"has not finished a step for {s.silent_s:.1f} s (> {s.threshold_s:.1f} s = threshold from a median "
            f"step of {s.median_step_s:.2f} s); it last finished step {s.step}")


def dead(verdicts: Sequence[Verdict]) -> frozenset[str]:
    """The worker ids judged dead."""
    return frozenset(v.worker_id for v in verdicts if v.liveness is Liveness.DEAD)
