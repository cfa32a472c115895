"""Planning a described cluster (``meridian plan SPEC --cluster CLUSTER.yaml``) with the planner the service runs.

On the topology and figures of a cluster file (:mod:`meridian.service.planning.described`) it answers: the plan
today's runtime offers (or why there is none); the fastest plan-only layout, where the features the runtime lacks
would make it faster or make the job fit at all; for several datacenters, the same job on one datacenter holding
all the GPUs, the two-datacenter efficiency against it, and the inter-DC bandwidth below which that efficiency
falls under :data:`TARGET_EFFICIENCY`. Pure: no Ray, no clock, no file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from meridian.service.errors import Unschedulable
from meridian.service.jobs import TopologyRequest
from meridian.service.planning.calibration import Calibration, calibrated_figures
from meridian.service.planning.candidates import Candidate
from meridian.service.planning.cost_model import estimate
from meridian.service.planning.described import ClusterSpec
from meridian.service.planning.plan import Plan
from meridian.service.planning.planner import fitting_layouts, plan_job
from meridian.service.planning.request import PlanRequest
from meridian.service.planning.runtime_support import EVERYTHING, RuntimeSupport, current_runtime

TARGET_EFFICIENCY = 0.96
"""The two-datacenter efficiency (step time on one datacenter over step time on two) the threshold is given for."""
GBPS_RANGE = (1e-2, 1e7)
"""Inter-DC bandwidths (Gbit/s) the threshold is searched between."""


@dataclass(frozen=True)
class OfflinePlan:
    cluster: ClusterSpec
    calibration: Calibration
    offered: Plan | None
    """What today's runtime runs (:data:`~meridian.service.planning.runtime_support.RUNTIME`); ``None``: nothing."""
    refusal: str
    """Why today's runtime offers no plan (empty when it offers one)."""
    plan_only: Plan | None
    """The fastest layout with every feature the planner models, where it beats ``offered`` or ``offered`` is
    ``None``; else ``None``."""
    one_dc: Plan | None = None
    """The same job on one datacenter holding every GPU (clusters of several datacenters)."""
    efficiency_vs_one_dc: float | None = None
    """``one_dc``'s step time over :attr:`headline`'s: 1.0 when the datacenters cost nothing."""
    inter_dc_gbps_at_target: float | None = None
    """The inter-DC bandwidth below which no layout that fits reaches :data:`TARGET_EFFICIENCY` of ``one_dc``
    (each layout re-estimated at each bandwidth; the fastest counts)."""
    layout_at_target: str = ""
    """The layout that reaches it there."""
    threshold_note: str = ""

    @property
    def headline(self) -> Plan:
        """The plan shown first: the plan-only one where it is faster (or the only fit), else the offered one."""
        plan = self.plan_only or self.offered
        assert plan is not None
        return plan

    def summary(self) -> str:
        """The headline's block, and a line each for what it is compared with."""
        lines = [self.headline.summary]
        if self.plan_only is not None:
            lines.append(f"offered     {self._offered_words()}")
        if self.efficiency_vs_one_dc is not None:
            assert self.one_dc is not None
            lines.append(f"vs one DC   {self.efficiency_vs_one_dc:.3f} of the same {self.cluster.gpus} GPUs in one "
                         f"datacenter ({_step(self.one_dc)} a step); {self._threshold_words()}")
        return "\n".join(lines)

    def _offered_words(self) -> str:
        if self.offered is None:
            return f"none today: {self.refusal}"
        gain = self.offered.estimate["step_s"] / self.headline.estimate["step_s"] - 1
        layout = self.offered.summary.splitlines()[0].removeprefix("layout").strip()
        return f"today's runtime runs {layout} at {_step(self.offered)} a step ({gain:.0%} slower)"

    def _threshold_words(self) -> str:
        if self.inter_dc_gbps_at_target is None:
            return self.threshold_note
        return (f"{TARGET_EFFICIENCY:.2f} needs {_gbps(self.inter_dc_gbps_at_target)} between the datacenters "
                f"({self.layout_at_target})")

    def to_dict(self, *, compare_one_dc: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster": {"gpus": self.cluster.gpus,
                        "datacenters": {dc.name: dc.nodes * dc.node.gpus for dc in self.cluster.datacenters},
                        "efficiency": self.calibration.efficiency, "calibration": self.calibration.source},
            "plan": _plan_dict(self.headline),
            "plan_only": bool(self.headline.plan_only),
            "offered": None if self.offered is None else _plan_dict(self.offered),
            "refusal": self.refusal,
        }
        if len(self.cluster.datacenters) > 1:
            out["inter_dc_gbps_at_target"] = self.inter_dc_gbps_at_target
            out["layout_at_target"] = self.layout_at_target
            out["target_efficiency"] = TARGET_EFFICIENCY
            out["threshold_note"] = self.threshold_note
            if compare_one_dc:
                out["one_dc"] = None if self.one_dc is None else _plan_dict(self.one_dc)
                out["efficiency_vs_one_dc"] = self.efficiency_vs_one_dc
        return out


def _plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan without its per-rank lists (a described cluster has no nodes to pin ranks to)."""
    d = plan.to_dict()
    for key in ("rank_datacenters", "rank_nodes"):
        d.pop(key)
    return d


def _step(plan: Plan) -> str:
    s = plan.estimate["step_s"]
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def _gbps(g: float) -> str:
    return f"{g / 1e3:.1f} Tbit/s" if g >= 1e3 else f"{g:.0f} Gbit/s"


def plan_described(request: PlanRequest, cluster: ClusterSpec) -> OfflinePlan:
    """Plan ``request`` on ``cluster``: :class:`OfflinePlan`. ``Unschedulable`` when no layout fits even with every
    feature the planner models (the reason names both refusals)."""
    topo = cluster.topology()
    figures, calibration = calibrated_figures(cluster)
    offered: Plan | None = None
    refusal = ""
    try:
        offered = plan_job(request, topo, figures, runtime=current_runtime())
    except Unschedulable as e:
        refusal = str(e)
    best: Plan | None = None
    try:
        best = plan_job(request, topo, figures, runtime=EVERYTHING)
    except Unschedulable as e:
        if offered is None:
            raise Unschedulable(f"{refusal} (even with every feature the planner models: {e})") from None
    if best is not None and offered is not None and best.estimate["step_s"] >= offered.estimate["step_s"]:
        best = None
    headline = best if best is not None else offered
    assert headline is not None
    result = OfflinePlan(cluster=cluster, calibration=calibration, offered=offered, refusal=refusal,
                         plan_only=best)
    if len(cluster.datacenters) < 2:
        return result
    if any(dc.node != cluster.datacenters[0].node for dc in cluster.datacenters):
        return replace(result, threshold_note="the datacenters' nodes differ, so there is no one-datacenter "
                                              "cluster of the same GPUs to compare with")
    return _against_one_dc(result, request, EVERYTHING if headline.plan_only else current_runtime())


def _against_one_dc(result: OfflinePlan, request: PlanRequest, runtime: RuntimeSupport) -> OfflinePlan:
    """``result`` with the one-datacenter plan, the efficiency against it and the bandwidth threshold."""
    one = result.cluster.one_datacenter()
    # the same job with the placement knobs that name datacenters left to the planner
    alone = replace(request, topology=TopologyRequest(min_workers=request.topology.min_workers),
                    parallelism=replace(request.parallelism, stages_span_dcs=None))
    efficiency_of_peak = result.calibration.efficiency
    one_dc = plan_job(alone, one.topology(), one.figures(efficiency_of_peak), runtime=runtime)
    reference = one_dc.estimate["step_s"]
    efficiency = reference / result.headline.estimate["step_s"]
    # what fits does not depend on the link: re-estimate every layout that fits at each bandwidth
    fits = fitting_layouts(request, result.cluster.topology(), result.cluster.figures(efficiency_of_peak),
                           runtime=runtime)

    def best_at(gbps: float) -> tuple[float, Candidate]:
        fig = result.cluster.with_inter_dc_gbps(gbps).figures(efficiency_of_peak)
        step, i = min((estimate(request.shape, c.layout, fig, request.global_batch).step_s, i)
                      for i, c in enumerate(fits))
        return reference / step, fits[i]

    threshold, at, note = None, "", ""
    lo, hi = (math.log10(g) for g in GBPS_RANGE)
    if best_at(10**hi)[0] < TARGET_EFFICIENCY:
        note = (f"no layout reaches {TARGET_EFFICIENCY:.2f} of one datacenter at any inter-DC bandwidth: the "
                "link's latency, not its bandwidth, is what the datacenters cost")
    elif best_at(10**lo)[0] >= TARGET_EFFICIENCY:
        threshold, note = 10**lo, "a layout sends almost nothing between the datacenters"
    else:
        for _ in range(40):  # the best efficiency rises with the bandwidth
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if best_at(10**mid)[0] < TARGET_EFFICIENCY else (lo, mid)
        threshold = 10**hi
        at = best_at(threshold)[1].name
        note = "the fastest layout that fits, each re-estimated at each bandwidth, against the one-datacenter plan"
    return replace(result, one_dc=one_dc, efficiency_vs_one_dc=efficiency, inter_dc_gbps_at_target=threshold,
                   layout_at_target=at, threshold_note=note)
