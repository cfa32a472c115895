"""The engine-ceiling benchmark compares like with like: the same ranks, job and buckets, one datacenter for flat."""

from __future__ import annotations

from meridian.bench.engine_ceiling import configs
from meridian.workers.contracts.config import SyncStrategy


def test_the_three_engines_train_the_same_job_on_the_same_ranks():
    runs = configs("nano", 2, steps=60, global_batch=16, micro_batch=4, bucket_mb=0.5)
    flat, exact, ahead = runs["flat"], runs["hierarchical"], runs["lookahead"]
    assert set(flat.datacenters) == {"dc-a"} and exact.datacenters == ahead.datacenters == ("dc-a",) * 2 + ("dc-b",) * 2
    assert len(flat.datacenters) == len(exact.datacenters)
    assert flat.sync.strategy is SyncStrategy.FLAT and exact.sync.strategy is ahead.sync.strategy is SyncStrategy.HIERARCHICAL
    assert not exact.sync.delay_one_step and ahead.sync.delay_one_step and ahead.sync.local_lookahead
    for cfg in runs.values():
        assert (cfg.model, cfg.steps, cfg.global_batch, cfg.micro_batch, cfg.sync.bucket_mb, cfg.optim) == (
            flat.model, 60, 16, 4, 0.5, flat.optim)
