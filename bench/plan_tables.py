"""``meridian bench plan-tables``: the planner against published tables, published vs predicted.

Command: ``meridian bench plan-tables --json``. Pure arithmetic (no training, no Ray): each published run planned
as ``meridian plan --cluster`` plans it, with the per-GPU efficiency fitted to other runs
(:data:`meridian.service.planning.calibration.CALIBRATION_RUNS`).

- The seed's job (NVIDIA, "Turbocharge LLM Training Across Long-Haul Data Center Networks with NVIDIA NeMo
  Framework", 2025): Nemotron-4 340B on 2 x 1,536 H100, 21 ms apart, MFU 51% on one datacenter and 49% on two
  (96%). The post gives no inter-DC bandwidth: planned at the example file's 400 Gbit/s and with each node reaching
  the other site at its own NIC's rate.
- Narayanan et al., SC '21, Table 1 (GPT 1.7B to 1T on 32 to 3,072 A100 80 GB): TFLOP/s per GPU of the published
  layout, and the layout the planner prefers with its reason.

Also measured: the wall time of planning the 3,072-GPU job (one plan; and the whole offline answer with the
one-datacenter comparison and the bandwidth threshold).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from meridian.service.jobs import ParallelismRequest
from meridian.service.planning.calibration import (
    CALIBRATION_RUNS,
    DGX_A100,
    MEGATRON_2021,
    NEMOTRON4_340B,
    PublishedRun,
    calibration_for,
    gpt_shape,
    predicted_step,
)
from meridian.service.planning.cost_model import Recompute
from meridian.service.planning.described import ClusterSpec, cluster_from_dict
from meridian.service.planning.request import PlanRequest
from meridian.workers.contracts.config import Precision

NAME = "plan-tables"
HELP = "the planner against published tables (the seed's Nemotron-4 340B, Megatron-LM's Table 1): published vs predicted"

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

SEED = {"gpus": 3072, "rtt_ms": 21, "global_batch": 2304, "mfu_one_dc": 0.51, "mfu_two_dc": 0.49,
        "efficiency_vs_one_dc": 0.96}
"""The seed's figures (NVIDIA's post; Nemotron-4 340B, sequence 4,096, batch 2,304 as in its report's last stage)."""

NARAYANAN_TABLE_1 = [  # params (B), heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
"""Narayanan et al., SC '21, Table 1: sequence 2,048, vocabulary 51,200, full activation recomputation."""


def table_1_run(row: tuple) -> PublishedRun:
    """A Table 1 row as the run it published (Megatron-LM of 2021: no sequence parallelism, the data-parallel
    all-reduce after the backward pass)."""
    params, heads, hidden, layers, tp, pp, gpus, batch, tflops = row
    return PublishedRun(source=f"Narayanan et al. 2021, Table 1, {params}B", nodes=gpus // 8, **DGX_A100,
                        shape=gpt_shape(layers=layers, hidden=hidden, heads=heads), tp=tp, pp=pp, global_batch=batch,
                        recompute=Recompute.FULL, tflops_per_gpu=tflops, overlap=False, runtime=MEGATRON_2021)


def seed_cluster(gbps: float | None = None) -> ClusterSpec:
    import yaml

    cluster = cluster_from_dict(yaml.safe_load((EXAMPLES / "clusters" / "nemotron-2dc.yaml").read_text()))
    return cluster if gbps is None else cluster.with_inter_dc_gbps(gbps)


def seed_request() -> PlanRequest:
    return PlanRequest(shape=NEMOTRON4_340B, global_batch=SEED["global_batch"], micro_batch=None, steps=100_000,
                       precision=Precision.BF16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # nothing to set: the tables are the published ones


def _seed_rows() -> list[dict[str, Any]]:
    from meridian.service.planning.offline import plan_described

    rows = []
    for label, gbps in (("example file, one 400 Gbit/s link", None), ("each node at its NIC's rate", 192 * 3200.0)):
        cluster = seed_cluster(gbps)
        result = plan_described(seed_request(), cluster)
        plan, one = result.headline, result.one_dc
        assert one is not None
        rows.append({
            "link": label, "inter_dc_gbps": cluster.links[0].gbps, "layout": plan.summary.splitlines()[0][12:],
            "plan_only": list(plan.plan_only), "memory_gib": round(plan.estimate["memory_bytes"] / 2**30, 1),
            "mfu_two_dc": round(plan.estimate["mfu"], 3), "mfu_one_dc": round(one.estimate["mfu"], 3),
            "efficiency_vs_one_dc": round(result.efficiency_vs_one_dc or 0, 3),
            "inter_dc_gbps_at_0.96": None if result.inter_dc_gbps_at_target is None
            else round(result.inter_dc_gbps_at_target),
            "step_s": round(plan.estimate["step_s"], 2), "one_dc_step_s": round(one.estimate["step_s"], 2),
        })
    return rows


def _table_1_rows() -> list[dict[str, Any]]:
    from meridian.service.planning.explain import why_not
    from meridian.service.planning.planner import fitting_layouts

    efficiency = calibration_for("A100").efficiency
    rows = []
    for row in NARAYANAN_TABLE_1:
        run = table_1_run(row)
        published = predicted_step(run, efficiency)
        cluster = run.cluster(efficiency)
        free = replace(run.request(), parallelism=ParallelismRequest(stages_span_dcs=False), recompute=None)
        best = fitting_layouts(free, cluster.topology(), cluster.figures(efficiency), runtime=run.runtime)[0]
        predicted = run.throughput(published.estimate.step_s)
        rows.append({
            "params_b": row[0], "gpus": row[6], "batch": row[7], "tp": row[4], "pp": row[5],
            "published_tflops": row[8], "predicted_tflops": round(predicted, 1), "ratio": round(predicted / row[8], 3),
            "as_planned": f"{published.name} micro-batch {published.layout.micro_batch}",
            "memory_gib": round(published.estimate.memory_bytes / 2**30, 1),
            "published_mfu": round(row[8] / 312, 3), "predicted_mfu": round(published.estimate.mfu, 3),
            "planner_prefers": best.name if best.name != published.name else "the published layout",
            "planner_mfu": round(best.estimate.mfu, 3),
            "why": why_not(best, published) if best.name != published.name else "",
        })
    return rows


def _planning_seconds() -> dict[str, float]:
    from meridian.service.planning.calibration import calibrated_figures
    from meridian.service.planning.offline import plan_described
    from meridian.service.planning.planner import plan_job
    from meridian.service.planning.runtime_support import EVERYTHING

    cluster, request = seed_cluster(), seed_request()
    figures, _ = calibrated_figures(cluster)
    t0 = time.perf_counter()
    plan_job(request, cluster.topology(), figures, runtime=EVERYTHING)
    t1 = time.perf_counter()
    plan_described(request, cluster)
    t2 = time.perf_counter()
    return {"plan_3072_gpus_s": round(t1 - t0, 3), "offline_answer_3072_gpus_s": round(t2 - t1, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    del args
    calibration = {kind: {"efficiency": round(calibration_for(kind).efficiency, 4), "fitted_to": r.source}
                   for kind, r in CALIBRATION_RUNS.items()}
    return {"seed": {"published": SEED, "predicted": _seed_rows()}, "narayanan_table_1": _table_1_rows(),
            "calibration": calibration, "timing": _planning_seconds()}


def render(r: dict[str, Any]) -> str:
    lines = ["seed: Nemotron-4 340B, 2 x 1,536 H100, 21 ms (published MFU 51% one DC, 49% two, 0.96)"]
    for s in r["seed"]["predicted"]:
        lines.append(f"  {s['link']}: {s['layout']}; MFU {s['mfu_one_dc']:.1%} one DC, {s['mfu_two_dc']:.1%} two, "
                     f"{s['efficiency_vs_one_dc']:.3f}; 0.96 needs {s['inter_dc_gbps_at_0.96']} Gbit/s")
    lines.append("Narayanan et al. 2021 Table 1 (TFLOP/s per GPU, published -> predicted)")
    for t in r["narayanan_table_1"]:
        lines.append(f"  {t['params_b']:>7}B tp={t['tp']} pp={t['pp']} on {t['gpus']}: {t['published_tflops']} -> "
                     f"{t['predicted_tflops']} ({t['ratio']:.2f}); prefers {t['planner_prefers']}")
    lines.append(f"timing: {r['timing']}")
    return "\n".join(lines)
