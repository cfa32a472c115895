"""The replica consistency check on real gloo processes: identical replicas pass, a perturbed one is named."""

from __future__ import annotations

import functools

import pytest

from meridian.bench.consistency import nudge_first_weight
from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.probes.consistency import check_consistency

CFG = TrainConfig(job_id="c", model=model_preset("nano"), steps=1, global_batch=2, micro_batch=2, seed=3)


def _check(rank, world, bad_rank, eps):
    perturb = functools.partial(nudge_first_weight, eps=eps) if rank == bad_rank else None
    return check_consistency(CFG, perturb=perturb)


def test_perturbed_replica_is_flagged_with_per_rank_numbers():
    reports = run_processes(_check, 3, 1, 1e-4, timeout_s=300)
    assert all(r == reports[0] for r in reports)  # every rank reaches the same verdict
    report = reports[0]
    assert report.world_size == 3 and report.reference_rank == 0
    assert report.inconsistent_ranks == [1]
    good, bad = report.ranks[0], report.ranks[1]
    assert report.ranks[2].loss == good.loss and report.ranks[2].grad_norm == good.grad_norm  # bit-identical
    assert report.ranks[2].max_param_diff == 0 and report.ranks[2].max_grad_diff == 0
    # The first feature of each of the 256 token embeddings shifted by 1e-4 (rounded to fp32).
    assert bad.param_checksum - good.param_checksum == pytest.approx(256 * 1e-4, rel=1e-3)
    assert bad.loss != good.loss and bad.max_grad_diff > 0


def test_identical_replicas_pass():
    report = run_processes(_check, 2, None, 0.0, timeout_s=300)[0]
    assert report.inconsistent_ranks == []
    assert all(r.max_param_diff == 0 and r.max_grad_diff == 0 and r.loss_diff == 0 for r in report.ranks)
