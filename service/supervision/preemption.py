"""Priority preemption, decided apart from doing it: which running jobs of lower priority to suspend so that a
queued job that cannot fit now can (:func:`victims`).

A job is suspended only if it can resume where it stopped: it keeps durable checkpoints and is data-parallel
only (a tensor/pipeline-parallel job trains in one epoch and has no step boundary to leave at). The lowest
priority goes first, and among equals the newest (it has trained least); no more jobs than needed. Jobs already
being suspended count as freed. Pure: no store, no Ray (tests/test_preemption.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.planning.placement import admission
from meridian.service.planning.plan import Plan


@dataclass(frozen=True, kw_only=True)
class Running:
    """A job that holds capacity now."""

    job_id: str
    priority: int
    seq: int
    """Submission order (newer: larger)."""
    plan: Plan
    nodes: tuple[str, ...]
    """The node of each of its ranks."""
    suspendable: bool
    suspending: bool = False
    """A suspension is under way already."""


def freed(topo: ClusterTopology, jobs: Sequence[Running]) -> ClusterTopology:
    """``topo`` with what ``jobs``' workers hold on their nodes given back."""
    back: dict[str, tuple[float, float]] = {}
    for j in jobs:
        cpus, gpus = j.plan.resources_per_worker.get("CPU", 0.0), j.plan.resources_per_worker.get("GPU", 0.0)
        for node in j.nodes:
            c, g = back.get(node, (0.0, 0.0))
            back[node] = (c + cpus, g + gpus)
    return ClusterTopology(tuple(
        replace(n, available_cpus=n.available_cpus + back[n.node_id][0],
                available_gpus=n.available_gpus + back[n.node_id][1]) if n.node_id in back else n
        for n in topo.nodes))


def victims(plan: Plan, priority: int, running: Sequence[Running], topo: ClusterTopology) -> list[Running] | None:
    """The jobs to suspend (beyond those being suspended already) so that ``plan`` fits, or ``None`` if
    suspending every candidate of lower priority would not make room. ``[]``: the suspensions under way do."""
    chosen = [j for j in running if j.suspending]
    if admission(plan, freed(topo, chosen)) is None:
        return []
    candidates = sorted((j for j in running if not j.suspending and j.suspendable and j.priority < priority),
                        key=lambda j: (j.priority, -j.seq))
    picked: list[Running] = []
    for j in candidates:
        picked.append(j)
        if admission(plan, freed(topo, chosen + picked)) is None:
            return picked
    return None
