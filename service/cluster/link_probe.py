"""Measure the cluster's link tiers with a collective benchmark run on the nodes themselves.

Tiers: ``intra_node`` (two processes on one node), ``intra_dc`` (two nodes of one datacenter) and
``inter_dc`` (one node in each of two datacenters, for every pair). Each tier runs
:func:`meridian.workers.probes.collective_bench.all_reduce_perf` in Ray actors pinned to chosen nodes by their
node-id label, and is summarised as latency + bus bandwidth for the planner. The last report is kept with
its timestamp (in memory and as JSON in the data directory).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meridian.service.cluster.topology import ClusterTopology, NodeInfo
from meridian.workers.contracts.link_perf import PerfRow, message_sizes, summarise

NODE_ID_LABEL = "ray.io/node-id"
TIERS = ("intra_node", "intra_dc", "inter_dc")


@dataclass(frozen=True)
class TierResult:
    tier: str
    nodes: tuple[str, ...]
    datacenters: tuple[str, ...]
    rows: tuple[dict[str, float], ...]

    def to_dict(self) -> dict[str, Any]:
        summary = summarise([PerfRow(**r) for r in self.rows]).to_dict()
        return {"tier": self.tier, "nodes": list(self.nodes), "datacenters": list(self.datacenters),
                "summary": summary, "rows": list(self.rows)}


@dataclass(frozen=True)
class ProbeReport:
    measured_at: float
    results: tuple[TierResult, ...] = field(default_factory=tuple)
    skipped: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"measured_at": self.measured_at, "tiers": [r.to_dict() for r in self.results],
                "skipped": list(self.skipped)}


def choose_pairs(topo: ClusterTopology, tiers: tuple[str, ...]) -> tuple[list[tuple[str, tuple[NodeInfo, ...]]], list[str]]:
    """Which nodes measure which tier; tiers this cluster cannot show are explained in ``skipped``."""
    plan: list[tuple[str, tuple[NodeInfo, ...]]] = []
    skipped = []
    dcs = topo.datacenters
    if "intra_node" in tiers:
        nodes = [n for dc in dcs for n in topo.nodes_in(dc)]
        if nodes:
            plan.append(("intra_node", (max(nodes, key=lambda n: n.cpus),)))
        else:
            skipped.append("intra_node: no labelled live node")
    if "intra_dc" in tiers:
        dc = next((dc for dc in dcs if len(topo.nodes_in(dc)) >= 2), None)
        if dc:
            plan.append(("intra_dc", topo.nodes_in(dc)[:2]))
        else:
            skipped.append("intra_dc: no datacenter has two live nodes")
    if "inter_dc" in tiers:
        if len(dcs) < 2:
            skipped.append("inter_dc: fewer than two datacenters")
        for a, b in itertools.combinations(dcs, 2):
            plan.append(("inter_dc", (topo.nodes_in(a)[0], topo.nodes_in(b)[0])))
    return plan, skipped


def run_probe(topo: ClusterTopology, *, tiers: tuple[str, ...] = TIERS, max_bytes: int = 64 * 2**20,
              timeout_s: float = 180.0) -> ProbeReport:
    """Run the benchmark on every tier this cluster has (Ray must be connected)."""
    import ray

    from meridian.workers.probes.probe_actor import ProbeActor

    unknown = set(tiers) - set(TIERS)
    if unknown:
        raise ValueError(f"unknown tier(s) {sorted(unknown)}; choose from {list(TIERS)}")
    sizes = message_sizes(max_bytes=max_bytes)
    actor_cls = ray.remote(num_cpus=0)(ProbeActor)
    plan, skipped = choose_pairs(topo, tiers)
    results = []
    for tier, nodes in plan:
        actors = [actor_cls.options(label_selector={NODE_ID_LABEL: n.node_id}).remote() for n in nodes]
        try:
            if tier == "intra_node":
                rows = ray.get(actors[0].run_intra_node.remote(sizes, timeout_s=timeout_s), timeout=timeout_s + 30)
            else:
                master = ray.get(actors[0].address.remote(), timeout=60)
                refs = [a.run.remote(master, r, len(actors), sizes, timeout_s) for r, a in enumerate(actors)]
                rows = ray.get(refs, timeout=timeout_s + 30)[0]
        finally:
            for a in actors:
                ray.kill(a)
        results.append(TierResult(tier, tuple(n.node_id for n in nodes),
                                  tuple(n.datacenter or "" for n in nodes), tuple(rows)))
    return ProbeReport(time.time(), tuple(results), tuple(skipped))


def compute_key(model: dict[str, Any], micro_batch: int, precision: str = "fp32") -> str:
    """The compute figure's key: the model's shape, the micro-batch, and the precision it trains in (a GPU runs
    bf16 autocast several times faster than fp32; fp32 keys keep their old form)."""
    key = f"L{model['n_layers']}-d{model['d_model']}-h{model['n_heads']}-s{model['seq_len']}-v{model['vocab_size']}-b{micro_batch}"
    return key if precision == "fp32" else f"{key}-{precision}"


def training_precision(precision: str, use_gpu: bool) -> str:
    """What a job with ``precision`` (``auto``, ``fp32``, ``bf16``) computes in on these devices: ``auto`` is bf16
    autocast on GPUs, fp32 on CPUs (:func:`meridian.workers.loop.precision.resolve_precision`)."""
    if precision == "auto":
        return "bf16" if use_gpu else "fp32"
    return precision


def run_compute_probe(topo: ClusterTopology, model: dict[str, Any], micro_batch: int, *, slots: dict[str, int],
                      use_gpu: bool = False, min_seconds: float = 3.0, precision: str = "fp32") -> dict[str, Any]:
    """Forward + backward throughput of ``model`` on every worker slot at once (as training runs), in
    ``precision`` (``fp32`` or ``bf16``: what the job computes in, :func:`training_precision`). ``slots``: node id →
    the workers it holds (the planner's count: a GPU worker takes a CPU too)."""
    import statistics

    import ray

    from meridian.workers.probes.probe_actor import ProbeActor

    actor_cls = ray.remote(num_cpus=0)(ProbeActor)
    actors = []
    for dc in topo.datacenters:
        for n in topo.nodes_in(dc):
            actors += [actor_cls.options(label_selector={NODE_ID_LABEL: n.node_id}, num_gpus=1 if use_gpu else 0).remote()
                       for _ in range(slots.get(n.node_id, 0))]
    if not actors:
        raise ValueError("no worker slot to measure: no labelled live node has CPUs/GPUs")
    try:
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=120)  # start together, measure together
        rows = ray.get([a.compute.remote(model, micro_batch, min_seconds, precision, use_gpu) for a in actors], timeout=300)
    finally:
        for a in actors:
            ray.kill(a)
    out = {
        "key": compute_key(model, micro_batch, precision), "precision": precision, "slots": len(rows), "measured_at": time.time(),
        "flops": statistics.median(r["flops"] for r in rows),
        "optimizer_step_s": statistics.median(r["optimizer_step_s"] for r in rows),
        "per_slot_flops": [r["flops"] for r in rows],
    }
    memories = [r["device_memory_bytes"] for r in rows if "device_memory_bytes" in r]
    if memories:  # GPU slots report their device's memory: plan for the smallest
        out["device_memory_bytes"] = min(memories)
    return out


class ProbeCache:
    """The latest probe report, kept in memory and in ``<data_dir>/diagnostics/collectives.json``."""

    def __init__(self, data_dir: str) -> None:
        self.path = Path(data_dir) / "diagnostics" / "collectives.json"
        self._report: dict[str, Any] | None = None

    def latest(self) -> dict[str, Any] | None:
        if self._report is None and self.path.exists():
            self._report = json.loads(self.path.read_text())
        return self._report

    def store(self, report: ProbeReport) -> dict[str, Any]:
        data = report.to_dict()
        data["compute"] = (self.latest() or {}).get("compute", {})  # keep compute figures measured earlier
        return self._write(data)

    def store_compute(self, entry: dict[str, Any]) -> dict[str, Any]:
        data = dict(self.latest() or {"measured_at": entry["measured_at"], "tiers": [], "skipped": []})
        data["compute"] = {**data.get("compute", {}), entry["key"]: entry}
        return self._write(data)

    def _write(self, data: dict[str, Any]) -> dict[str, Any]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)
        self._report = data
        return data
