"""The planner's memory figure against one training step's peak as measured on an H100 and an H200
(``tests/data/h100_step_memory.json``, ``h200_step_memory.json``: ``meridian bench memory``'s measurements;
gpt2-124m and llama-160m, bf16 autocast and fp32, micro-batches 2 to 16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meridian.bench import memory
from meridian.workers.contracts.model_config import model_preset

DATA = Path(__file__).parent / "data"
MEASURED = {gpu: json.loads((DATA / f"{gpu}_step_memory.json").read_text()) for gpu in ("h100", "h200")}
ROWS = [(gpu, row) for gpu, m in MEASURED.items() for row in m["rows"]]


@pytest.mark.parametrize("gpu, row", ROWS, ids=lambda v: v if isinstance(v, str) else
                         f"{v['model']}-{v['precision']}-b{v['micro_batch']}")
def test_the_planner_s_memory_figure_is_near_the_measured_peak_and_never_far_below(gpu, row):
    assert model_preset(row["model"]).num_params == row["params"]  # the measured model is the preset's
    ratio = memory.planner_estimate(row["model"], row["micro_batch"], row["precision"]) / row["peak_bytes"]
    # bf16 keeps some saved tensors in 16 bits, which the estimate counts as fp32: above, by up to ~20%. In fp32
    # the figure missed one fp32 copy of the logits: 0.90x on the H200 at micro-batch 8 (a layout that does not
    # fit passed); now 1.0-1.15x.
    assert 0.95 <= ratio <= 1.25, ratio


@pytest.mark.parametrize("gpu", sorted(MEASURED))
def test_the_estimate_grows_with_the_micro_batch_as_the_measurement_does(gpu):
    rows = {(r["model"], r["precision"], r["micro_batch"]): r for r in MEASURED[gpu]["rows"]}
    for (model, precision, b), r in rows.items():
        for (m2, p2, b2), r2 in rows.items():
            if (m2, p2) == (model, precision) and b2 > b:
                measured = (r2["peak_bytes"] - r2["base_bytes"]) / (r["peak_bytes"] - r["base_bytes"])
                estimated = ((memory.planner_estimate(model, b2, precision) - 12 * r["params"])
                             / (memory.planner_estimate(model, b, precision) - 12 * r["params"]))
                assert estimated == pytest.approx(measured, rel=0.2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_bench_memory_refuses_a_host_without_cuda():
    from meridian.cli.bench import main

    assert main(["memory", "--json"]) == 1


@pytest.mark.parametrize("gpus, auto_is_fp32", [(1, False), (0, True)])
def test_the_planner_counts_fp32_logits_for_an_fp32_job_and_for_auto_on_cpus(gpus, auto_is_fp32):
    from dataclasses import replace

    from fakes import node

    from meridian.service.cluster.topology import ClusterTopology
    from meridian.service.jobs import JobRequest, ParallelismRequest
    from meridian.service.planning.planner import plan_job
    from meridian.workers.contracts.config import Precision

    topo = ClusterTopology((replace(node("a", "dc-a", cpus=16, gpus=gpus), memory_bytes=512 * 2**30),))
    model = model_preset("gpt2-124m")

    from meridian.service.planning.runtime_support import RUNTIME

    def planned(precision: Precision) -> float:
        # fp32 weights under both precisions (no bf16 compute weights), so the logits are the one difference
        # and one tensor-parallel rank: sequence parallelism would cut the logits over the ranks
        request = JobRequest(name="m", model=model, steps=2, global_batch=8, micro_batch=8, precision=precision,
                             parallelism=ParallelismRequest(tp=1, pp=1))
        return plan_job(request, topo, runtime=replace(RUNTIME, bf16_weights=False)).estimate["memory_bytes"]

    one_fp32_logits = 8 * 4 * model.seq_len * model.vocab_size
    assert planned(Precision.FP32) - planned(Precision.BF16) == pytest.approx(one_fp32_logits)
    assert planned(Precision.AUTO) == planned(Precision.FP32 if auto_is_fp32 else Precision.BF16)
