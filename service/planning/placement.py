"""Where a job's workers can go: datacenters, worker slots per node, rank placement, admission now.

Pure functions of the request and the cluster as read (no Ray calls). They answer "how many workers fit
where" and "which node and datacenter does each rank get"; choosing a layout and explaining it is for
:mod:`meridian.service.planning.planner` and :mod:`meridian.service.planning.explain`.
"""

from __future__ import annotations

from meridian.service.cluster.topology import ClusterTopology, NodeInfo
from meridian.service.errors import InvalidJob, Unschedulable
from meridian.service.planning.candidates import Candidate
from meridian.service.planning.plan import Plan
from meridian.service.planning.request import PlanRequest

CPUS_PER_WORKER = 1.0


def worker_unit(use_gpu: bool) -> str:
    """What one worker takes, in words ("GPU", "1 CPU")."""
    return "GPU" if use_gpu else f"{CPUS_PER_WORKER:g} CPU"


def worker_resources(use_gpu: bool) -> dict[str, float]:
    """What Ray reserves for one worker (the plan's ``resources_per_worker``): its CPUs, and one GPU on GPUs."""
    return {"CPU": CPUS_PER_WORKER, **({"GPU": 1.0} if use_gpu else {})}


def slots(node: NodeInfo, per_worker: dict[str, float], *, available: bool = False) -> int:
    """How many workers asking Ray for ``per_worker`` a node can hold (``available``: in its free resources now).
    A slot is there only where every resource of a worker is: Ray places a worker whole or not at all, so a GPU
    node whose CPUs other work holds has GPUs free but no slot."""
    have = {"CPU": node.available_cpus if available else node.cpus,
            "GPU": node.available_gpus if available else node.gpus}
    return max(0, int(min((have.get(r, 0.0) // need for r, need in per_worker.items() if need > 0), default=0)))


def worker_slots(node: NodeInfo, *, use_gpu: bool, available: bool = False) -> int:
    """How many workers a node can hold: one per GPU with a CPU to go with it, or one per ``CPUS_PER_WORKER``
    CPUs (:func:`slots` of :func:`worker_resources`)."""
    return slots(node, worker_resources(use_gpu), available=available)


def choose_datacenters(request: PlanRequest, topo: ClusterTopology) -> tuple[str, ...]:
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


def devices_per_dc(request: PlanRequest, topo: ClusterTopology, dcs: tuple[str, ...], use_gpu: bool) -> dict[str, list[int]]:
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
    # [node, slots left, free slots left]: a tensor-parallel group goes where its slots are free now if any node
    # has them (the queue admits the plan only then, :func:`admission`), else where they will be
    left = {dc: [[n.node_id, worker_slots(n, use_gpu=use_gpu), worker_slots(n, use_gpu=use_gpu, available=True)]
                 for n in sorted(nodes[dc], key=lambda n: -worker_slots(n, use_gpu=use_gpu))]
            for dc in c.datacenters}
    dcs, pins = [], []
    for stage in range(lay.pp):
        for replica in range(lay.dp):
            dc = c.datacenters[stage // per_dc_stages] if lay.pp_spans_dcs else replica_dc[replica]
            node = None
            if lay.tp > 1:
                fits = [s for s in left[dc] if s[1] >= lay.tp]
                slot = next((s for s in fits if s[2] >= lay.tp), fits[0])
                slot[1] -= lay.tp
                slot[2] -= lay.tp
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
    free = _free_slots_left(plan, topo, pins)
    order = {dc: sorted((n.node_id for n in topo.nodes_in(dc)), key=lambda i: (-free.get(i, 0), i))
             for dc in set(plan.rank_datacenters)}  # fmt: skip
    for rank, (dc, node) in enumerate(zip(plan.rank_datacenters, pins, strict=True)):
        if node is None:  # the first node in the order with room left: consecutive ranks share a node
            pins[rank] = next((i for i in order[dc] if free.get(i, 0) > 0), None)
            if pins[rank] is not None:
                free[pins[rank]] -= 1
    return tuple(pins)


def _per_worker(plan: Plan) -> dict[str, float]:
    return plan.resources_per_worker or worker_resources(plan.use_gpu)


def _free_slots_left(plan: Plan, topo: ClusterTopology, pins: list[str | None]) -> dict[str, int]:
    """Free worker slots per live node now, less the ranks ``pins`` puts on it (negative: over-subscribed)."""
    free = {n.node_id: slots(n, _per_worker(plan), available=True) for n in topo.alive_nodes}
    for node in pins:
        if node is not None:
            free[node] = free.get(node, 0) - 1
    return free


def admission(plan: Plan, topo: ClusterTopology) -> str | None:
    """``None`` if the plan fits in the free capacity now, else why it must wait (e.g. 'waiting for 2
    CPUs in dc-b'). Counted per node, as Ray places workers: a slot is free only where every resource of
    ``plan.resources_per_worker`` is; ranks the plan pinned to a node (a tensor-parallel group) need their slots
    free on that node, the others any free slot left in their datacenter (:func:`pin_ranks_to_nodes`, which pins
    them at launch from the same count). Admitted otherwise, the job would sit in placing until its deadline."""
    per_worker = _per_worker(plan)
    pins = list(plan.rank_nodes or (None,) * plan.num_workers)
    free = _free_slots_left(plan, topo, pins)
    short = []
    for node_id in dict.fromkeys(p for p in pins if p is not None):
        if free[node_id] < 0:
            node = topo.node(node_id)
            alive = [node] if node is not None and node.alive else []
            where = f"node {node_id} in {node.datacenter}" if alive and node else f"node {node_id}, which is gone,"
            amount, note = _amount(pins.count(node_id), -free[node_id], per_worker, alive)
            short.append(f"{amount} on {where} where the plan keeps a tensor-parallel group of {plan.tp} "
                         f"together{note}")
    for dc in plan.datacenters:
        need = sum(1 for d, p in zip(plan.rank_datacenters, pins, strict=True) if d == dc and p is None)
        have = sum(max(0, free[n.node_id]) for n in topo.nodes_in(dc))
        if have < need:
            amount, note = _amount(plan.workers_in(dc), need - have, per_worker, list(topo.nodes_in(dc)))
            short.append(f"{amount} in {dc}{note}")
    return f"waiting for {' and '.join(short)}" if short else None


def _amount(workers: int, missing: int, per_worker: dict[str, float], nodes: list[NodeInfo]) -> tuple[str, str]:
    """What ``missing`` of ``workers`` workers wait for on ``nodes``, in words, and a note: the one resource that
    is short ('2 GPUs') when freeing that much of it would make room; else room for the workers, with what each
    takes together on one node (e.g. free GPUs on one node and free CPUs on another)."""
    def words(r: str, amount: float) -> str:
        return f"{amount:g} {r}{'s' if amount != 1 else ''}"

    each = " and ".join(words(r, v) for r, v in per_worker.items())
    note = "" if len(per_worker) == 1 else f" (each worker takes {each} on one node)"
    alone = {r: sum(slots(n, {r: need}, available=True) for n in nodes) for r, need in per_worker.items()}
    short = [r for r in per_worker if alone[r] < workers]
    if len(short) == 1 and workers - alone[short[0]] == missing:
        return words(short[0], missing * per_worker[short[0]]), note
    return f"room for {missing} more worker{'s' if missing != 1 else ''}", note
