"""Where a job's ranks run, as the runner learns it from its events: :class:`PlacedRank` per rank, kept by
:class:`PlacementTracker`. An ``epoch_formed`` names the ranks of a new membership, each joined with what its
worker said when it started (host, pid, device); a ``worker_started`` with a rank comes from a runner that ranks
workers itself. The runner's poll carries the result, so the service never rebuilds it from stored events. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from meridian.workers.contracts.events import EpochFormed, EventKind, JobEvent, WorkerStarted


@dataclass(frozen=True, kw_only=True)
class PlacedRank:
    rank: int
    worker_id: str
    node_id: str
    datacenter: str
    hostname: str = ""
    pid: int = 0
    ray_worker_id: str = ""
    """Ray's id of the worker process (its log file's name on the node)."""
    device: str = ""


class PlacementTracker:
    """The current ranks after every event seen so far."""

    def __init__(self) -> None:
        self.started: dict[str, WorkerStarted] = {}
        self.ranks: tuple[PlacedRank, ...] = ()

    def observe(self, event: JobEvent) -> bool:
        """Follow ``event``; whether it changed the ranks."""
        before = self.ranks
        if event.kind is EventKind.WORKER_STARTED:
            w: WorkerStarted = event.payload
            self.started[w.worker_id] = w
            if w.rank is not None:
                kept = [p for p in self.ranks if p.rank != w.rank]
                self.ranks = tuple(sorted([*kept, _placed(w.rank, w.worker_id, w.node_id, w.datacenter, w)],
                                          key=lambda p: p.rank))
        elif event.kind is EventKind.EPOCH_FORMED:
            e: EpochFormed = event.payload
            self.ranks = tuple(_placed(s.rank, s.worker_id, s.node_id, s.datacenter, self.started.get(s.worker_id))
                               for s in e.placement)
        return self.ranks is not before


def _placed(rank: int, worker_id: str, node_id: str, dc: str, started: WorkerStarted | None) -> PlacedRank:
    return PlacedRank(rank=rank, worker_id=worker_id, node_id=node_id, datacenter=dc,
                      hostname=started.hostname if started else "", pid=started.pid if started else 0,
                      ray_worker_id=started.ray_worker_id if started else "",
                      device=started.device if started else "")
