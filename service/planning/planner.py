"""Decide where and how a job runs: a :class:`Plan` from a request, the cluster and its measured links.

Pure functions of their inputs (no Ray calls), so every decision is tested without a cluster. The
planner answers three questions:

1. Can the cluster *ever* hold this job? Otherwise :class:`Unschedulable` with the reason (e.g. "the model
   needs 92 GB per device with tp=1; tp=2 fits").
2. Which layout is fastest? It enumerates tensor-parallel sizes (never more than the devices of one node),
   pipeline depths (stages inside each datacenter, or stages spanning datacenters) and data-parallel sync
   strategies, estimates each with :mod:`meridian.service.planning.cost_model`, and keeps the fastest that fits,
   explaining what it beat and why.
3. Can it start *now*? (:func:`admission`, used by the queue.)

The principle from the product brief: bandwidth-hungry tensor parallelism stays inside a node, data and
pipeline parallelism may cross datacenters, and data-parallel gradients cross them hierarchically.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from meridian.service.cluster.topology import ClusterTopology, NodeInfo
from meridian.service.errors import InvalidJob, Unschedulable
from meridian.service.jobs import JobRequest
from meridian.service.planning.cost_model import Estimate, Figures, Layout, estimate, runs_hierarchical
from meridian.service.planning.sync_choice import choose_sync
from meridian.workers.contracts.config import DiLoCoConfig, SyncStrategy
from meridian.workers.contracts.fields import to_plain

CPUS_PER_WORKER = 1.0
TP_SIZES = (1, 2, 4, 8)
MAX_PP = 8


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    datacenters: tuple[str, ...]
    replicas_per_dc: tuple[int, ...]
    """Model replicas placed in each datacenter (stage-spanning layouts: stages per datacenter)."""
    estimate: Estimate
    rejected: str = ""

    @property
    def name(self) -> str:
        lay = self.layout
        parts = [f"tp={lay.tp}", f"pp={lay.pp}" + (" across DCs" if lay.pp_spans_dcs else ""), f"dp={lay.dp}"]
        if lay.dp > 1 and not lay.pp_spans_dcs and lay.num_dcs > 1:
            parts.append("hierarchical" if lay.hierarchical else "flat")
        return " ".join(parts)

    def summary(self) -> dict[str, Any]:
        e = self.estimate
        return {"layout": self.name, "tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp,
                "stages_span_dcs": self.layout.pp_spans_dcs, "hierarchical": self.layout.hierarchical,
                "est_step_s": round(e.step_s, 6), "memory_gb": round(e.memory_bytes / 2**30, 3),
                "inter_dc_bytes_per_step": int(e.inter_dc_bytes), "rejected": self.rejected}


@dataclass(frozen=True)
class Plan:
    datacenters: tuple[str, ...]
    """Datacenters used, in rank order."""
    rank_datacenters: tuple[str, ...]
    """Datacenter of each world rank."""
    use_gpu: bool
    sync_strategy: SyncStrategy
    """The planner's choice: the job's ``sync.strategy`` when it asked for one, else the fastest; the
    TrainConfig's ``sync.strategy`` is this (:func:`~meridian.service.planning.train_config.build_train_config`)."""
    explanation: str
    diloco: DiLoCoConfig | None = None
    """H, fragments, overlap when ``sync_strategy`` is a DiLoCo one (:mod:`meridian.service.planning.sync_choice`)."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    stages_span_dcs: bool = False
    micro_batches: int = 1
    rank_nodes: tuple[str | None, ...] = ()
    """Node each rank is pinned to (tensor-parallel groups share a node); ``None``: any node of its DC."""
    estimate: dict[str, float] = field(default_factory=dict)
    alternatives: tuple[dict[str, Any], ...] = ()

    @property
    def num_workers(self) -> int:
        return len(self.rank_datacenters)

    @property
    def dp(self) -> int:
        return self.num_workers // (self.tp * self.pp)

    def workers_in(self, dc: str) -> int:
        return self.rank_datacenters.count(dc)

    def to_dict(self) -> dict[str, Any]:
        return {
            "datacenters": list(self.datacenters),
            "workers_per_datacenter": {dc: self.workers_in(dc) for dc in self.datacenters},
            "num_workers": self.num_workers,
            "rank_datacenters": list(self.rank_datacenters),
            "rank_nodes": list(self.rank_nodes) if self.rank_nodes else [None] * self.num_workers,
            "parallelism": {"tp": self.tp, "pp": self.pp, "dp": self.dp, "schedule": self.schedule,
                            "stages_span_dcs": self.stages_span_dcs, "micro_batches": self.micro_batches},
            "use_gpu": self.use_gpu,
            "resources_per_worker": self.resources_per_worker,
            "sync_strategy": self.sync_strategy.value,
            "diloco": None if self.diloco is None else to_plain(self.diloco),
            "estimate": self.estimate,
            "alternatives": list(self.alternatives),
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


def _devices_per_dc(request: JobRequest, topo: ClusterTopology, dcs: tuple[str, ...], use_gpu: bool) -> dict[str, list[int]]:
    """Slots per node (largest first) in each DC, capped by the request's workers per datacenter."""
    unit = "GPU" if use_gpu else f"{CPUS_PER_WORKER:g} CPU"
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


def _shrink(counts: dict[str, int], limit: int) -> dict[str, int]:
    """Remove replicas from the largest datacenter first until at most ``limit`` remain (every replica
    needs at least one sample per step)."""
    counts = dict(counts)
    while sum(counts.values()) > limit:
        biggest = max(counts, key=lambda dc: counts[dc])
        counts[biggest] -= 1
    return counts


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def enumerate_candidates(request: JobRequest, dcs: tuple[str, ...], devices: dict[str, list[int]],
                         figures: Figures) -> list[Candidate]:
    """Every layout the cluster can run for this request, each with its estimate (unsorted)."""
    model = request.model
    par = request.parallelism
    tps = [par.tp] if par.tp else [t for t in TP_SIZES if model.n_heads % t == 0 and (model.mlp_ratio * model.d_model) % t == 0]
    pps = [par.pp] if par.pp else _divisors(model.n_layers, MAX_PP)
    used = tuple(dc for dc in dcs if devices[dc])
    out: list[Candidate] = []
    for tp in tps:
        groups = {dc: sum(s // tp for s in devices[dc]) for dc in used}  # TP groups that fit per DC
        if not any(groups.values()):
            continue
        for pp in pps:
            if pp > 1 and request.sync.strategy is SyncStrategy.FLAT:
                continue  # DDP (flat) cannot follow a pipeline schedule; the workers refuse that combination
            spans_options = [False, True] if par.stages_span_dcs is None else [par.stages_span_dcs]
            for spans in spans_options:
                if spans:
                    if len(used) < 2 or pp % len(used):
                        continue
                    per_dc = pp // len(used)
                    dp = min(groups[dc] // per_dc for dc in used)
                    replicas = tuple(per_dc for _ in used)
                    dcs_here = used
                else:
                    replicas_full = _shrink({dc: groups[dc] // pp for dc in used}, request.global_batch)
                    dcs_here = tuple(dc for dc in used if replicas_full[dc] > 0)
                    replicas = tuple(replicas_full[dc] for dc in dcs_here)
                    dp = sum(replicas)
                if dp < 1 or dp > request.global_batch:
                    continue
                dp_per_dc_values = set(replicas) if not spans else {0}
                # pp > 1 runs the hierarchical engine only (DDP cannot follow a pipeline schedule)
                strategies = [True] if spans or len(dcs_here) == 1 or pp > 1 else [True, False]
                if request.sync.strategy is not None and not spans and len(dcs_here) > 1:
                    strategies = [request.sync.strategy is SyncStrategy.HIERARCHICAL]
                for hierarchical in strategies:
                    m = max(1, -(-request.global_batch // dp // request.micro_batch))
                    lay = Layout(
                        tp=tp, pp=pp, dp=dp, num_dcs=len(dcs_here),
                        dp_per_dc=0 if spans else min(dp_per_dc_values), pp_spans_dcs=spans,
                        micro_batch=request.micro_batch, micro_batches=m, hierarchical=hierarchical,
                        shard_optimizer=request.sync.shard_optimizer, overlap=request.sync.overlap,
                        schedule=request.parallelism.schedule, bucket_bytes=request.sync.bucket_mb * 2**20,
                    )
                    est = estimate(model, lay, figures, request.global_batch)
                    rejected = ""
                    if est.memory_bytes > figures.device_memory_bytes:
                        rejected = (f"needs {est.memory_bytes / 2**30:.1f} GB per device, "
                                    f"devices have {figures.device_memory_bytes / 2**30:.1f} GB")
                    out.append(Candidate(lay, dcs_here, replicas, est, rejected))
    return out


def _rank_placement(c: Candidate, devices: dict[str, list[int]], nodes: dict[str, list[NodeInfo]], use_gpu: bool) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
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


def plan_job(request: JobRequest, topo: ClusterTopology, figures: Figures | None = None) -> Plan:
    """The fastest layout this job can get on this cluster (raises if it can never fit)."""
    dcs = _choose_datacenters(request, topo)
    use_gpu = topo.has_gpus(dcs)
    figures = figures or default_figures(topo, dcs, use_gpu)
    devices = _devices_per_dc(request, topo, dcs, use_gpu)
    total = sum(sum(v) for v in devices.values())
    unit = "GPU" if use_gpu else f"{CPUS_PER_WORKER:g} CPU"
    if total == 0:
        raise Unschedulable(f"no worker fits in {', '.join(dcs)} (each worker needs one {unit})")
    dp_only = request.parallelism.is_data_parallel_only
    if request.topology.workers_per_datacenter is not None and total > request.global_batch and dp_only:
        raise InvalidJob(
            f"training.global_batch ({request.global_batch}) is smaller than the number of workers ({total}); "
            "every worker needs at least one sample per step"
        )
    cands = enumerate_candidates(request, dcs, devices, figures)
    if request.topology.workers_per_datacenter is not None:
        # Explicit worker counts: use every requested device.
        cands = [c for c in cands if c.layout.devices == total]
    if not cands:
        raise Unschedulable(_no_layout_reason(request, devices, unit))
    feasible = sorted((c for c in cands if not c.rejected), key=lambda c: (c.estimate.step_s, -c.layout.devices))
    if not feasible:
        smallest = min(cands, key=lambda c: c.estimate.memory_bytes)
        raise Unschedulable(
            f"no layout fits in device memory ({figures.device_memory_bytes / 2**30:.1f} GB): "
            + "; ".join(f"{c.name} {c.rejected.split(',')[0]}" for c in sorted(cands, key=lambda c: c.layout.tp)[:4])
            + f". The smallest footprint is {smallest.name} at {smallest.estimate.memory_bytes / 2**30:.1f} GB; "
            "use a smaller model, a smaller micro_batch, or devices with more memory"
        )
    best = feasible[0]
    choice = None  # per-step sync across DCs, or DiLoCo? Only on a link that was measured or declared.
    data_parallel = [c for c in feasible if c.layout.num_dcs > 1 and c.layout.pp == 1 and c.layout.tp == 1]
    if request.sync.strategy is None and figures.inter_dc_known and data_parallel:
        dp = data_parallel[0]
        choice = choose_sync(rtt_ms=figures.inter_dc.latency_s * 2000, gbps=figures.inter_dc.bytes_per_s * 8 / 1e9,
                             num_params=request.model.num_params, compute_s=dp.estimate.compute_s,
                             num_dcs=dp.layout.num_dcs, overlap=request.sync.overlap, bucket_mb=request.sync.bucket_mb)
        if choice.strategy.is_diloco:
            # DiLoCo hides the link behind H inner steps: it beats any per-step layout (a stage-spanning
            # pipeline included) when its compute plus the amortised outer sync is shorter.
            assert choice.diloco is not None
            if dp.estimate.compute_s + choice.outer_sync_s / choice.diloco.inner_steps < best.estimate.step_s:
                best = dp
            else:
                choice = None
        elif best is not dp:
            choice = None
    if best.layout.devices < request.topology.min_workers:
        raise Unschedulable(
            f"the job needs at least topology.min_workers={request.topology.min_workers} workers "
            f"but the best layout uses {best.layout.devices} (the cluster holds {total})"
        )
    rank_dcs, rank_nodes = _rank_placement(best, devices, {dc: list(topo.nodes_in(dc)) for dc in best.datacenters}, use_gpu)
    strategy = request.sync.strategy or strategy_for(best.layout)
    reason = _sync_reason(strategy, requested=request.sync.strategy is not None, num_dcs=best.layout.num_dcs,
                          pp=best.layout.pp, spans=best.layout.pp_spans_dcs)
    diloco = request.sync.diloco if strategy.is_diloco else None
    if choice is not None and (choice.strategy.is_diloco or strategy is SyncStrategy.HIERARCHICAL):
        strategy, diloco, reason = choice.strategy, choice.diloco, " " + choice.explanation
    resources = {"CPU": CPUS_PER_WORKER, **({"GPU": 1.0} if use_gpu else {})}
    alternatives = tuple(c.summary() for c in sorted(cands, key=lambda c: (bool(c.rejected), c.estimate.step_s))[:8])
    return Plan(
        datacenters=best.datacenters, rank_datacenters=rank_dcs, use_gpu=use_gpu, sync_strategy=strategy,
        explanation=explain(best, feasible[1:], [c for c in cands if c.rejected], unit) + reason, diloco=diloco,
        resources_per_worker=resources, tp=best.layout.tp, pp=best.layout.pp,
        schedule=request.parallelism.schedule, stages_span_dcs=best.layout.pp_spans_dcs,
        micro_batches=best.layout.micro_batches, rank_nodes=rank_nodes,
        estimate={k: round(v, 6) for k, v in best.estimate.to_dict().items()}, alternatives=alternatives,
    )


def strategy_for(lay: Layout) -> SyncStrategy:
    """The data-parallel engine that runs ``lay`` when the job leaves the choice to the planner."""
    # With pipeline stages the DP sync must be the hierarchical engine (DDP cannot follow a schedule);
    # inside one DC it is a reduce-scatter + all-gather, the same traffic as a ring all-reduce.
    return SyncStrategy.HIERARCHICAL if runs_hierarchical(lay) else SyncStrategy.FLAT


def ranked_layouts(
    request: JobRequest, topo: ClusterTopology, figures: Figures
) -> list[tuple[Candidate, tuple[str, ...]]]:
    """Every layout that fits, fastest estimate first, with the datacenter of each rank: what
    ``meridian bench plan`` runs to check the estimates against measured step times."""
    dcs = _choose_datacenters(request, topo)
    use_gpu = topo.has_gpus(dcs)
    devices = _devices_per_dc(request, topo, dcs, use_gpu)
    total = sum(sum(v) for v in devices.values())
    cands = [c for c in enumerate_candidates(request, dcs, devices, figures) if not c.rejected]
    if request.topology.workers_per_datacenter is not None:
        cands = [c for c in cands if c.layout.devices == total]
    nodes = {dc: list(topo.nodes_in(dc)) for dc in dcs}
    return [(c, _rank_placement(c, devices, nodes, use_gpu)[0])
            for c in sorted(cands, key=lambda c: (c.estimate.step_s, -c.layout.devices))]


def _sync_reason(strategy: SyncStrategy, *, requested: bool, num_dcs: int, pp: int = 1, spans: bool = True) -> str:
    if requested:
        return f" Sync '{strategy.value}' (as requested)."
    if strategy is SyncStrategy.HIERARCHICAL and pp > 1 and num_dcs == 1:
        return (" Sync 'hierarchical' inside the datacenter (chosen: pipeline stages need it; in one datacenter "
                "it is a reduce-scatter + all-gather, the traffic of a flat all-reduce).")
    if strategy is SyncStrategy.HIERARCHICAL:
        return (" Sync 'hierarchical' (chosen: reduce-scatter inside each datacenter, all-reduce of 1/N of the "
                "gradients across, all-gather inside).")
    if num_dcs == 1:
        return " Sync 'flat' (chosen: one datacenter, so a flat all-reduce is the shortest path)."
    if not spans:
        return " Sync 'flat' (chosen: its estimated step time beat hierarchical sync for this layout)."
    return " Sync 'flat' inside each datacenter (chosen: pipeline stages, not gradients, cross datacenters)."


def _no_layout_reason(request: JobRequest, devices: dict[str, list[int]], unit: str) -> str:
    par = request.parallelism
    if par.tp and all(s < par.tp for v in devices.values() for s in v):
        biggest = max((s for v in devices.values() for s in v), default=0)
        return f"parallelism.tp={par.tp} needs {par.tp} devices on one node; the largest node has {biggest} {unit} slot(s)"
    return (f"no (tp, pp, dp) layout of {request.model.n_layers} layers / {request.model.n_heads} heads fits "
            f"{sum(sum(v) for v in devices.values())} workers with global_batch={request.global_batch}")


def explain(best: Candidate, others: list[Candidate], rejected: list[Candidate], unit: str) -> str:
    lay, e = best.layout, best.estimate
    where = ", ".join(f"{r} replica(s) in {dc}" if not lay.pp_spans_dcs else f"{r} stage(s) in {dc}"
                      for dc, r in zip(best.datacenters, best.replicas_per_dc, strict=True))
    text = (f"{lay.devices} worker(s), one per {unit}: {best.name} ({where}); estimated {e.step_s * 1e3:.0f} ms/step, "
            f"{e.memory_bytes / 2**20:.0f} MiB per device, {e.inter_dc_bytes / 2**20:.1f} MiB across datacenters per step.")
    if others:
        nxt = others[0]
        text += f" Next best: {nxt.name} at {nxt.estimate.step_s * 1e3:.0f} ms/step ({_why_slower(best, nxt)})."
    if rejected:
        text += f" Rejected {len(rejected)} layout(s) that do not fit in memory (e.g. {rejected[0].name}: {rejected[0].rejected})."
    return text


def _why_slower(best: Candidate, other: Candidate) -> str:
    a, b = best.estimate, other.estimate
    diffs = {
        "pipeline bubble and transfers": (b.compute_s + b.pp_comm_s) - (a.compute_s + a.pp_comm_s),
        "tensor-parallel all-reduces": b.tp_comm_s - a.tp_comm_s,
        "exposed gradient sync": b.exposed_dp_s - a.exposed_dp_s,
    }
    reason, delta = max(diffs.items(), key=lambda kv: kv[1])
    return f"+{delta * 1e3:.0f} ms of {reason}" if delta > 0 else "slower overall"


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


def default_figures(topo: ClusterTopology, dcs: tuple[str, ...], use_gpu: bool) -> Figures:
    """Conservative figures when nothing was measured or declared (replaced by probe results when present)."""
    from meridian.service.planning.cost_model import Link

    nodes = [n for dc in dcs for n in topo.nodes_in(dc)]
    if use_gpu:
        memory, flops = 40 * 2**30, 100e12
    else:
        per_slot = [n.memory_bytes / max(1, worker_slots(n, use_gpu=False)) for n in nodes]
        memory, flops = (min(per_slot) if per_slot else 2**30), 5e9
    return Figures(device_flops=flops, device_memory_bytes=memory,
                   intra_node=Link(20e-6, 100e9 / 8), intra_dc=Link(50e-6, 25e9 / 8), inter_dc=Link(10e-3, 10e9 / 8))


def with_figures(figures: Figures, **changes: Any) -> Figures:
    return replace(figures, **changes)
