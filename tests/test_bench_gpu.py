"""``meridian bench gpu`` off a GPU: its spec is one the API takes, its plain loop trains, and it refuses to run
without CUDA rather than measure a CPU (the GPU runs themselves: docs/benchmarks/gpu.md)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from meridian.api.schemas import JobSpec
from meridian.bench import gpu


def _args(**kw) -> argparse.Namespace:
    base = {"model": "nano", "steps": 4, "global_batch": 4, "micro_batch": 2, "precision": "bf16", "api": None,
            "timeout_s": 60.0}
    return argparse.Namespace(**{**base, **kw})


def test_the_job_is_the_plain_loops_model_batch_and_precision_on_one_worker():
    request = JobSpec.model_validate(gpu.job_spec(_args(model="gpt2-124m", steps=60, global_batch=32,
                                                        micro_batch=16))).to_request()
    assert request.model.n_layers == 12 and request.steps == 60 and request.global_batch == 32
    assert request.micro_batch == 16 and request.precision.value == "bf16"
    assert request.topology.workers_per_datacenter == 1


def test_the_plain_loop_trains_the_same_model_and_times_the_steps_after_the_first():
    out = gpu.plain_side(_args(steps=6), torch.device("cpu"))
    assert out["tokens_per_s"] > 0 and out["timed_s"] > 0 and math.isfinite(out["final_loss"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_without_a_gpu_it_says_so_instead_of_measuring_a_cpu():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        gpu.run(_args())


def test_the_steady_state_is_the_second_half_of_the_jobs_steps():
    step_s = {1: 2.0, 2: 1.5, 3: 0.2, 4: 0.1, 5: 0.1, 6: 0.1}  # a slow start, then 0.1 s steps
    assert gpu.second_half_tokens_per_s(step_s, 1000) == pytest.approx(10_000)
    assert gpu.second_half_tokens_per_s({}, 1000) is None
