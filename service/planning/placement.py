"""Where a job's workers can go: datacenters, worker slots per node, rank placement, admission now.

Pure functions of the request and the cluster as read (no Ray calls). They answer "how many workers fit
where" and "which node and datacenter does each rank get"; choosing a layout and explaining it is for
:mod:`meridian.service.planning.planner` and :mod:`meridian.service.planning.explain`.
"""

from __future__ import annotations

from meridian.service.cluster.topology import ClusterTopology, NodeInfo
from meridian.service.errors import InvalidJob, Unschedulable
from meridian.service.jobs import JobRequest
from meridian.service.planning.candidates import Candidate
from meridian.service.planning.plan import Plan

CPUS_PER_WORKER = 1.0


def worker_unit(use_gpu: bool) -> str:
    """What one worker takes, in words ("GPU", "1 CPU")."""
    return "GPU" if use_gpu else f"{CPUS_PER_WORKER:g} CPU"


def worker_slots(node: NodeInfo, *, use_gpu: bool, available: bool = False) -> int:
    """How many workers a node can hold: one per GPU, or one per ``CPUS_PER_WORKER`` CPUs."""
    if use_gpu:
        return int(node.available_gpus if available else node.gpus)
    return int((node.available_cpus if available else node.cpus) // CPUS_PER_WORKER)


def choose_datacenters(request: JobRequest, topo: ClusterTopology) -> tuple[str, ...]:
    known = topo.datacenters
    if not known:
        raise Unschedulable(
            "no live node has a 'datacenter' label; start nodes with `ray start --labels datacenter=<name>` "
            "(or run `meridian serve --local-datacenters dc-a:2,dc-b:2` for a local simulated cluster)"
        )
    wanted = request.topology.datacenters
    if wanted is None:
        # With 'auto', counts for a datacenter the cluster does not have would be dropped without a word, and
        # the job would run on another layout than the one asked for (a misspelt name, a datacenter that is down).
        w = request.topology.workers_per_datacenter
        unknown = sorted({dc for dc, _ in w} - set(known)) if isinstance(w, tuple) else []
        if unknown:
            raise Unschedulable(
                f"topology.workers_per_datacenter names {', '.join(map(repr, unknown))}, which has no live node in "
                f"this cluster; it has {', '.join(map(repr, known))}. Use one of those"
            )
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


def devices_per_dc(request: JobRequest, topo: ClusterTopology, dcs: tuple[str, ...], use_gpu: bool) -> dict[str, list[int]]:
    """Slots per node (largest first) in each DC, capped by the request's workers per datacenter."""
    unit = worker_unit(use_gpu)
    out: dict[str, list[int]] = {}
    for dc in dcs:
        slots = sorted((worker_slots(n, use_gpu=use_gpu) for n in topo.nodes_in(dc)), reverse=True)
        total = sum(slots)
        asked = request.topology.workers_in(dc)
        if asked is not None and asked > total:
            raise Unschedulable(
                f"{dc} can hold at most {total} worker(s) (one per {unit} on its live nodes), "
                f"but the job asks for {asked}; lower topology.workers_per_datacenter or add nodes to {dc}"
            )
        if asked is not None:
            capped, left = [], asked
            for s in slots:
                capped.append(min(s, left))
                left -= capped[-1]
            slots = [s for s in capped if s > 0]
        out[dc] = [s for s in slots if s > 0]
    return out


def rank_placement(c: Candidate, devices: dict[str, list[int]], nodes: dict[str, list[NodeInfo]], use_gpu: bool) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    """DC and node of each world rank, ranks ordered (pp stage, dp replica, tp) with tp fastest."""
    lay = c.layout
    # replica index → DC, and for stage-spanning layouts, stage → DC
    replica_dc: list[str] = []
    if not lay.pp_spans_dcs:
        for dc, r in zip(c.datacenters, c.replicas_per_dc, strict=True):
            replica_dc += [dc] * r
    per_dc_stages = lay.pp // len(c.datacenters) if lay.pp_spans_dcs else 0
    free = {dc: [[n.node_id, worker_slots(n, use_gpu=use_gpu)] for n in sorted(nodes[dc], key=lambda n: -worker_slots(n, use_gpu=use_gpu))]
            for dc in c.datacenters}
    dcs, pins = [], []
    for stage in range(lay.pp):
        for replica in range(lay.dp):
            dc = c.datacenters[stage // per_dc_stages] if lay.pp_spans_dcs else replica_dc[replica]
            node = None
            if lay.tp > 1:
                slot = next(s for s in free[dc] if s[1] >= lay.tp)
                slot[1] -= lay.tp
                node = slot[0]
            dcs += [dc] * lay.tp
            pins += [node] * lay.tp
    return tuple(dcs), tuple(pins)


def pin_ranks_to_nodes(plan: Plan, topo: ClusterTopology) -> tuple[str | None, ...]:
    """The node each rank starts on, chosen from the free capacity now (when the job is launched, not when it
    was planned): ranks the plan pinned keep their node (a tensor-parallel group); the others fill their
    datacenter's nodes one after the other, the node with most free slots first. ``None`` where the datacenter
    has no free slot left for it (its worker then takes any node of the datacenter once one frees up).

    Why pin every rank: Ray Train keeps its workers in one placement group. When a node dies, Ray reschedules
    the lost bundle; a bundle any node of the datacenter could take stays "feasible", and Ray 2.60's GCS retries
    it in a busy loop (``meridian bench pgspin``: 98 % of a core for as long as the bundle is missing, 0.7 % with
    the bundle pinned to its dead node, whose loss makes it infeasible). Meridian never needs that bundle back: a lost worker
    is replaced by a worker of its own outside the group."""
    pins = list(plan.rank_nodes or (None,) * plan.num_workers)
    free = {n.node_id: worker_slots(n, use_gpu=plan.use_gpu, available=True) for n in topo.alive_nodes}
    for node in pins:
        if node is not None and node in free:
            free[node] -= 1
    order = {dc: sorted((n.node_id for n in topo.nodes_in(dc)), key=lambda i: (-free.get(i, 0), i))
             for dc in set(plan.rank_datacenters)}  # fmt: skip
    for rank, (dc, node) in enumerate(zip(plan.rank_datacenters, pins, strict=True)):
        if node is None:  # the first node in the order with room left: consecutive ranks share a node
            pins[rank] = next((i for i in order[dc] if free.get(i, 0) > 0), None)
            if pins[rank] is not None:
                free[pins[rank]] -= 1
    return tuple(pins)


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
