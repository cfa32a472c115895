"""The hardware figures a plan is computed with: measured where a probe ran, declared where the user gave
them, the emulated WAN where the job asks for one, conservative defaults otherwise.

Precedence for the inter-datacenter link: the job's emulated WAN (that *is* the link its collectives will
see) > figures declared in the job spec > the latest probe > defaults. Intra-node and intra-DC tiers come
from the probe when there is one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from meridian.service.cluster.link_probe import compute_key, training_precision
from meridian.service.cluster.topology import ClusterTopology
from meridian.service.jobs import JobRequest
from meridian.service.planning.cost_model import Figures, Link
from meridian.service.planning.planner import default_figures
from meridian.workers.contracts.fields import to_plain


def _link(summary: dict[str, float]) -> Link:
    return Link(latency_s=summary["latency_us"] / 1e6, bytes_per_s=summary["bandwidth_gbps"] * 1e9 / 8)


def figures_for(request: JobRequest, topo: ClusterTopology, probe: dict[str, Any] | None,
                gpu_memory: dict[str, int] | None = None) -> tuple[Figures, list[str]]:
    """Figures for planning ``request``, and where each came from (for the plan's explanation).
    ``gpu_memory``: node id → its GPUs' memory as read on the node (:mod:`meridian.service.cluster.gpu_memory`),
    used where no compute probe reported the devices' memory."""
    dcs = request.topology.datacenters or topo.datacenters
    use_gpu = topo.has_gpus(tuple(dcs))
    fig = default_figures(topo, tuple(dcs), use_gpu)
    sources = ["defaults"]
    if probe:
        tiers: dict[str, Link] = {}
        for t in probe.get("tiers", []):
            # With several DC pairs, plan for the slowest measured one.
            link = _link(t["summary"])
            if t["tier"] not in tiers or link.bytes_per_s < tiers[t["tier"]].bytes_per_s:
                tiers[t["tier"]] = link
        fig = replace(fig, **{k: v for k, v in tiers.items() if k in ("intra_node", "intra_dc", "inter_dc")},
                      inter_dc_known="inter_dc" in tiers)
        sources = [f"link probe of {time.strftime('%Y-%m-%d %H:%M', time.localtime(probe.get('measured_at', 0)))}"] if tiers else []
        measured = probe.get("compute") or {}
        precision = training_precision(request.precision.value, use_gpu)
        compute = measured.get(compute_key(to_plain(request.model), request.micro_batch, precision))
        if compute:
            fig = replace(fig, device_flops=compute["flops"], step_overhead_s=compute["optimizer_step_s"],
                          compute_known=True)
            sources.append("compute probe of this model shape")
        # A device's memory does not depend on the model shape probed: any GPU compute probe tells it.
        memories = [c["device_memory_bytes"] for c in measured.values() if c.get("device_memory_bytes")]
        if use_gpu and memories:
            fig = replace(fig, device_memory_bytes=float(min(memories)), device_memory_known=True)
            sources.append("device memory reported by the devices")
        sources = sources or ["defaults"]
    if not fig.device_memory_known:  # a GPU job whose devices' memory no probe reported
        nodes = [n.node_id for dc in dcs for n in topo.nodes_in(dc) if n.gpus > 0]  # a CPU-only node holds no worker
        read = [gpu_memory[n] for n in nodes if gpu_memory and n in gpu_memory]
        if nodes and len(read) == len(nodes):
            fig = replace(fig, device_memory_bytes=float(min(read)), device_memory_known=True)
            sources.append("GPU memory read on the nodes")
        else:
            sources.append(f"GPU memory guessed at {fig.device_memory_bytes / 2**30:.0f} GiB (not read on "
                           f"{len(nodes) - len(read)} of {len(nodes)} nodes; `meridian probe --compute` measures it)")
    relevant = [lk for lk in request.links if lk.a in dcs and lk.b in dcs] if request.topology.datacenters else list(request.links)
    if relevant:
        slowest = min(relevant, key=lambda lk: lk.gbps)
        fig = replace(fig, inter_dc=Link(slowest.rtt_ms / 2000, slowest.gbps * 1e9 / 8), inter_dc_known=True)
        sources.append("declared inter-DC links")
    if request.wan:
        fig = replace(fig, inter_dc=Link(request.wan.one_way_s, request.wan.bytes_per_s), inter_dc_known=True)
        sources.append("the job's emulated WAN")
    return fig, sources
