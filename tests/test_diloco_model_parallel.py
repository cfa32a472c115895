"""DiLoCo with tensor or pipeline parallelism trains like the data-parallel-only DiLoCo run.

Two DCs, one replica in each, the same nano model, seed and samples: splitting each replica over tp=2 or pp=2
ranks changes who holds which parameter, not the gradient each DC's inner step sees (its mean over the DC's
samples). So the gradient norm every step reports, what clipping acts on, and the loss curve must match the
dp-only run to float rounding. grad_clip=2.0 sits inside the reference's range of norms: the first steps clip,
later ones do not, so a norm off by any factor changes the update as well as the report. Streaming DiLoCo runs
the same engine (one fragment, its all-reduce landing a step late and mixed in), so it is checked the same way.
"""

from __future__ import annotations

import pytest

from meridian.workers.contracts.config import (
    DiLoCoConfig,
    OptimConfig,
    ParallelConfig,
    PipelineSchedule,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train

STEPS = 8
CLIP = 2.0

DILOCO = {
    "diloco": DiLoCoConfig(inner_steps=2),
    "streaming-diloco": DiLoCoConfig(inner_steps=2, fragments=1, overlap_steps=1),
}


def _run(rank, world, cfg):
    sink = ListSink()
    train(cfg, sink=sink)
    return [r.grad_norm for r in sink.records], [r.loss for r in sink.records]


def config(strategy: str, dcs: tuple[str, ...], *, tp: int = 1, pp: int = 1) -> TrainConfig:
    return TrainConfig(
        job_id="t", model=model_preset("nano"), steps=STEPS, global_batch=6, micro_batch=3, datacenters=dcs, seed=1,
        optim=OptimConfig(lr=3e-3, grad_clip=CLIP, warmup_steps=2),
        sync=SyncConfig(strategy=SyncStrategy(strategy), diloco=DILOCO[strategy]),
        parallel=ParallelConfig(tp=tp, pp=pp, schedule=PipelineSchedule.GPIPE),
    )


@pytest.fixture(scope="module")
def dp_only():
    """strategy -> (grad norms, losses) of DiLoCo over two single-rank DCs, computed once per strategy."""
    cache: dict[str, tuple[list[float], list[float]]] = {}

    def get(strategy: str) -> tuple[list[float], list[float]]:
        if strategy not in cache:
            norms, losses = run_processes(_run, 2, config(strategy, ("a", "b")), timeout_s=180)[0]
            assert max(norms) > CLIP > min(norms), norms  # clipping acts on some steps and not on others
            cache[strategy] = norms, losses
        return cache[strategy]

    return get


@pytest.mark.parametrize("strategy", ["diloco", "streaming-diloco"])
@pytest.mark.parametrize("dcs, tp, pp", [
    (("a", "a", "b", "b"), 2, 1),  # tp=2 inside each DC
    (("a", "b", "a", "b"), 1, 2),  # pp=2, replicas in different DCs
])
def test_diloco_with_model_parallelism_matches_the_data_parallel_run(strategy, dcs, tp, pp, dp_only):
    ref_norms, ref_losses = dp_only(strategy)
    out = run_processes(_run, len(dcs), config(strategy, dcs, tp=tp, pp=pp), timeout_s=180)
    assert len(out[0][0]) == STEPS  # rank 0 records the job's steps
    for norms, losses in out:  # and every other rank that records reports the same
        if norms:
            assert norms == pytest.approx(ref_norms, rel=1e-4)  # the norm over the whole replica, scaled once
            assert losses == pytest.approx(ref_losses, rel=1e-4)
