"""Decide where a job runs: a :class:`Plan` from a :class:`JobRequest` and the cluster's topology.

Pure functions of their inputs (no Ray calls), so every decision is tested without a cluster. The
planner answers two questions: can the cluster *ever* hold this job (else :class:`Unschedulable` with the
reason), and can it hold it *now* (:func:`admission`, used by the queue).

Layout rule from the product brief: data parallelism spans datacenters; ranks of one datacenter are
contiguous so the bandwidth-hungry intra-DC steps stay inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meridian.service.errors import InvalidJob, Unschedulable
from meridian.service.jobs import JobRequest
from meridian.service.topology import ClusterTopology, NodeInfo
from meridian.workers.config import SyncStrategy

CPUS_PER_WORKER = 1.0


@dataclass(frozen=True)
class Plan:
    datacenters: tuple[str, ...]
    """Datacenters used, in rank order."""
    rank_datacenters: tuple[str, ...]
    """Datacenter of each world rank."""
    use_gpu: bool
    sync_strategy: SyncStrategy
    explanation: str
    resources_per_worker: dict[str, float] = field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        return len(self.rank_datacenters)

    def workers_in(self, dc: str) -> int:
        return self.rank_datacenters.count(dc)

    def to_dict(self) -> dict[str, Any]:
        return {
            "datacenters": list(self.datacenters),
            "workers_per_datacenter": {dc: self.workers_in(dc) for dc in self.datacenters},
            "num_workers": self.num_workers,
            "rank_datacenters": list(self.rank_datacenters),
            "use_gpu": self.use_gpu,
            "resources_per_worker": self.resources_per_worker,
            "sync_strategy": self.sync_strategy.value,
            "explanation": self.explanation,
        }


def worker_slots(node: NodeInfo, *, use_gpu: bool, available: bool = False) -> int:
    """How many workers a node can hold: one per GPU, or one per ``CPUS_PER_WORKER`` CPUs."""
    if use_gpu:
        return int(node.available_gpus if available else node.gpus)
    return int((node.available_cpus if available else node.cpus) // CPUS_PER_WORKER)


def _choose_datacenters(request: JobRequest, topo: ClusterTopology) -> tuple[str, ...]:
    known = topo.datacenters
    if not known:
        raise Unschedulable(
            "no live node has a 'datacenter' label; start nodes with `ray start --labels datacenter=<name>` "
            "(or run `meridian serve --local-datacenters dc-a:2,dc-b:2` for a local simulated cluster)"
        )
    wanted = request.topology.datacenters
    if wanted is None:
        return known
    if not wanted:
        raise InvalidJob("topology.datacenters must name at least one datacenter, or be 'auto'")
    missing = [dc for dc in wanted if dc not in known]
    if missing:
        raise Unschedulable(
            f"datacenter(s) {', '.join(map(repr, missing))} have no live node in this cluster; "
            f"it has {', '.join(map(repr, known))}. Use one of those or topology.datacenters='auto'"
        )
    if len(set(wanted)) != len(wanted):
        raise InvalidJob(f"topology.datacenters lists a datacenter twice: {list(wanted)}")
    return tuple(wanted)


def plan_job(request: JobRequest, topo: ClusterTopology) -> Plan:
    """The layout this job gets on this cluster, if it can ever fit (raises otherwise)."""
    dcs = _choose_datacenters(request, topo)
    use_gpu = topo.has_gpus(dcs)
    unit = "GPU" if use_gpu else f"{CPUS_PER_WORKER:g} CPU"
    counts: dict[str, int] = {}
    for dc in dcs:
        slots = sum(worker_slots(n, use_gpu=use_gpu) for n in topo.nodes_in(dc))
        asked = request.topology.workers_in(dc)
        if asked is None:
            counts[dc] = slots
        elif asked > slots:
            raise Unschedulable(
                f"{dc} can hold at most {slots} worker(s) (one per {unit} on its live nodes), "
                f"but the job asks for {asked}; lower topology.workers_per_datacenter or add nodes to {dc}"
            )
        else:
            counts[dc] = asked
    if request.topology.datacenters is None and not isinstance(request.topology.workers_per_datacenter, tuple):
        dcs = tuple(dc for dc in dcs if counts[dc] > 0)
    empty = [dc for dc in dcs if counts[dc] <= 0]
    if empty or not dcs:
        raise Unschedulable(
            f"no worker fits in {', '.join(empty) or 'any datacenter'} (each worker needs one {unit})"
        )
    total = sum(counts.values())
    if request.topology.workers_per_datacenter is None and total > request.global_batch:
        # Auto-sized: never more workers than samples per step.
        counts = _shrink(counts, request.global_batch)
        total = sum(counts.values())
    if total > request.global_batch:
        raise InvalidJob(
            f"training.global_batch ({request.global_batch}) is smaller than the number of workers ({total}); "
            "every worker needs at least one sample per step"
        )
    if total < request.topology.min_workers:
        raise Unschedulable(
            f"the job needs at least topology.min_workers={request.topology.min_workers} workers "
            f"but the cluster can hold {total}"
        )
    strategy = request.sync_strategy or (SyncStrategy.HIERARCHICAL if len(dcs) > 1 else SyncStrategy.FLAT)
    why = (
        f"{total} worker(s): " + ", ".join(f"{counts[dc]} in {dc}" for dc in dcs)
        + f"; one worker per {unit}. "
        + (
            f"Sync '{strategy.value}'"
            + (" (chosen: hierarchical all-reduce sends only 1/N of the gradients across datacenters)"
               if request.sync_strategy is None and len(dcs) > 1 else
               " (chosen: one datacenter, so a flat all-reduce is the shortest path)"
               if request.sync_strategy is None else " (as requested)")
        )
    )
    resources = {"CPU": CPUS_PER_WORKER, **({"GPU": 1.0} if use_gpu else {})}
    ranks = tuple(dc for dc in dcs for _ in range(counts[dc]))
    return Plan(dcs, ranks, use_gpu, strategy, why, resources)


def _shrink(counts: dict[str, int], limit: int) -> dict[str, int]:
    """Remove workers from the largest datacenter first until at most ``limit`` remain."""
    counts = dict(counts)
    while sum(counts.values()) > limit:
        biggest = max(counts, key=lambda dc: counts[dc])
        counts[biggest] -= 1
    return counts


def admission(plan: Plan, topo: ClusterTopology) -> str | None:
    """``None`` if the plan fits in the free capacity now, else why it must wait (e.g. 'waiting for 2
    CPUs in dc-b')."""
    short = []
    for dc in plan.datacenters:
        free = sum(worker_slots(n, use_gpu=plan.use_gpu, available=True) for n in topo.nodes_in(dc))
        need = plan.workers_in(dc)
        if free < need:
            unit = "GPU" if plan.use_gpu else "CPU"
            amount = (need - free) * (1 if plan.use_gpu else CPUS_PER_WORKER)
            short.append(f"{amount:g} {unit}{'s' if amount != 1 else ''} in {dc}")
    return f"waiting for {' and '.join(short)}" if short else None
