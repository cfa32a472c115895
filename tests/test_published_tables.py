"""The planner against published tables, each run planned the way ``meridian plan --cluster`` plans it.

The per-GPU efficiency is fitted to other runs (:data:`meridian.service.planning.calibration.CALIBRATION_RUNS`:
Narayanan et al. 2021 Table 2 for the A100, the Nemotron-4 340B report's Table 2 for the H100), never to these.

Sources:
- The seed's job: NVIDIA, "Turbocharge LLM Training Across Long-Haul Data Center Networks with NVIDIA NeMo
  Framework" (technical blog, 2025): Nemotron-4 340B on 3,072 H100 in two datacenters about 1,000 km apart (21 ms
  round trip) at 96% of the one-datacenter throughput, MFU 49% against 51%. The post gives no inter-DC bandwidth.
- D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC '21,
  Table 1: GPT models of 1.7B to 1T parameters on 32 to 3,072 A100 80 GB (DGX A100, 8 x 200 Gbit/s HDR per node),
  sequence 2,048, vocabulary 51,200, full activation recomputation, TFLOP/s per GPU counting the recomputation.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from meridian.bench.plan_tables import NARAYANAN_TABLE_1, table_1_run
from meridian.cli.main import load_spec
from meridian.cli.plan import offline_request
from meridian.service.errors import Unschedulable
from meridian.service.jobs import ParallelismRequest
from meridian.service.planning.calibration import (
    CALIBRATION_RUNS,
    calibration_for,
    predicted_step,
)
from meridian.service.planning.described import cluster_from_dict
from meridian.service.planning.explain import why_not
from meridian.service.planning.offline import TARGET_EFFICIENCY, plan_described
from meridian.service.planning.planner import fitting_layouts, plan_job
from meridian.service.planning.runtime_support import RUNTIME

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GIB_80 = 80 * 2**30


def _seed(gbps: float | None = None):
    cluster = cluster_from_dict(yaml.safe_load((EXAMPLES / "clusters" / "nemotron-2dc.yaml").read_text()))
    if gbps is not None:
        cluster = cluster.with_inter_dc_gbps(gbps)
    request = offline_request(load_spec(str(EXAMPLES / "offline" / "nemotron-340b.yaml")), base=EXAMPLES / "offline")
    return plan_described(request, cluster)


def test_the_seed_s_job_fits_and_runs_near_the_published_mfu_in_one_and_two_datacenters():
    # The post gives no inter-DC bandwidth. Its 96% says the link was not what limited the job; here each node
    # reaches the other site at its own NIC's rate (192 x 3.2 Tbit/s): 21 ms of latency is then all the
    # datacenters cost.
    result = _seed(gbps=192 * 3200)
    plan, one_dc = result.headline, result.one_dc
    assert not plan.plan_only and one_dc is not None  # the runtime runs it: offered to a job
    assert result.offered is not None and not result.refusal
    assert plan.estimate["memory_bytes"] <= GIB_80 and one_dc.estimate["memory_bytes"] <= GIB_80
    assert abs(one_dc.estimate["mfu"] - 0.51) <= 0.08
    assert abs(plan.estimate["mfu"] - 0.49) <= 0.08
    assert result.efficiency_vs_one_dc is not None and result.efficiency_vs_one_dc >= 0.96
    assert plan.datacenters == ("iad", "ord") and {plan.workers_in(dc) for dc in plan.datacenters} == {1536}
    # the plan names the bandwidth below which per-step sync falls under 0.96, here far below what it has
    assert result.inter_dc_gbps_at_target is not None and result.inter_dc_gbps_at_target < 192 * 3200


def test_at_400_gbit_s_the_seed_s_job_falls_short_and_the_plan_says_what_bandwidth_it_needs():
    # The example file: one 400 Gbit/s link. Per-step sync moves 2.7 TB of fp32 gradients a step across it,
    # so the best the planner finds keeps whole pipelines' activations crossing instead, at far less than 0.96.
    result = _seed()
    assert result.efficiency_vs_one_dc is not None and result.efficiency_vs_one_dc < TARGET_EFFICIENCY
    assert result.inter_dc_gbps_at_target is not None and result.inter_dc_gbps_at_target > 10 * 400
    assert result.headline.estimate["memory_bytes"] <= GIB_80
    lines = result.summary().splitlines()
    assert any(line.startswith("vs one DC") and "needs" in line and "Tbit/s" in line for line in lines)


TABLE_1 = NARAYANAN_TABLE_1  # Narayanan et al. 2021, Table 1, as meridian bench plan-tables prints it


def test_no_table_1_row_is_a_calibration_run():
    calibration = CALIBRATION_RUNS["A100"]
    rows = {(r[3], r[2], r[6], r[7]) for r in TABLE_1}
    assert (calibration.shape.n_layers, calibration.shape.hidden, calibration.gpus, calibration.global_batch) not in rows


@pytest.mark.parametrize("row", TABLE_1, ids=lambda r: f"{r[0]}B")
def test_narayanan_table_1_fits_80_gb_and_runs_within_15_percent_of_the_published_tflops(row):
    run = table_1_run(row)
    efficiency = calibration_for("A100").efficiency
    assert abs(round(run.shape.num_params / 1e9, 1) - row[0]) <= 0.05 * row[0]  # their eq. 2 counts the same model
    published = predicted_step(run, efficiency)  # the published tp x pp, the planner's micro-batch and v
    assert (published.layout.tp, published.layout.pp) == (row[4], row[5])
    assert published.estimate.memory_bytes <= GIB_80
    predicted = run.throughput(published.estimate.step_s)
    assert predicted == pytest.approx(row[8], rel=0.15), predicted

    # Left to choose the layout, the planner prefers one at least as fast by its own model, and says why.
    cluster = run.cluster(efficiency)
    free = replace(run.request(), parallelism=ParallelismRequest(stages_span_dcs=False), recompute=None)
    best = fitting_layouts(free, cluster.topology(), cluster.figures(efficiency), runtime=run.runtime)[0]
    assert best.estimate.step_s <= published.estimate.step_s * (1 + 1e-9)
    if best.name != published.name:
        why = why_not(best, published)
        assert "faster than" in why and any(part in why for part in (
            "recomputation", "pipeline bubble", "tensor-parallel", "gradient sync", "FSDP")), why


def test_llama3_8b_plans_data_parallel_with_fsdp_on_one_node():
    # Issue 55: with only the AdamW state sharded, one replica per GPU "needs 144.6 GB per device". The runtime
    # shards parameters and gradients too (FSDP2): the same job is offered data parallelism on one node.
    cluster = cluster_from_dict(yaml.safe_load((EXAMPLES / "clusters" / "workstation-8gpu.yaml").read_text()))
    request = offline_request(load_spec(str(EXAMPLES / "llama3-8b.yaml")), base=EXAMPLES)
    figures = cluster.figures(calibration_for("H100").efficiency)
    topo = cluster.topology()
    dp_only = replace(request, parallelism=ParallelismRequest(tp=1, pp=1))
    offered = plan_job(dp_only, topo, figures, runtime=RUNTIME)
    assert (offered.tp, offered.pp, offered.dp, offered.sharding, offered.plan_only) == (1, 1, 8, "fsdp", ())
    assert offered.estimate["memory_bytes"] <= GIB_80
    # its 8 micro-batches accumulate whole fp32 gradients anyway; the whole bf16 weights fit beside them, so FSDP
    # gathers each block once a step instead of 16 times
    assert not offered.reshard_after_forward and "the device holds them" in offered.explanation
    assert offered.to_dict()["parallelism"]["reshard_after_forward"] is False
    # without FSDP (only the optimizer state sharded) it does not fit, as the issue found
    with pytest.raises(Unschedulable, match=r"no layout fits in device memory.*tp=1 pp=1 dp=8 fsdp would fit at [0-9.]+ GB "
                                            r"per device once the runtime runs FSDP sharding"):
        plan_job(dp_only, topo, figures, runtime=replace(RUNTIME, fsdp=False))
