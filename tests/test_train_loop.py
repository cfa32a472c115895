"""The training loop on real multi-process gloo groups: every layout trains the same model."""

from __future__ import annotations

import pytest

from meridian.workers.contracts.config import SyncConfig, SyncStrategy, TrainConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train


def _run(rank, world, cfg):
    sink = ListSink()
    result = train(cfg, sink=sink)
    return result, [r.loss for r in sink.records]


def config(dcs, strategy="hierarchical", steps=8) -> TrainConfig:
    return TrainConfig(job_id="t", model=model_preset("nano"), steps=steps, global_batch=6, micro_batch=2,
                       datacenters=dcs, sync=SyncConfig(strategy=SyncStrategy(strategy)), seed=1)


@pytest.fixture(scope="module")
def single_process_losses():
    (result, losses), = run_processes(_run, 1, config(("a",)))
    return losses


@pytest.mark.parametrize("dcs, strategy", [
    (("a", "a", "b", "b"), "hierarchical"),
    (("a", "a", "b"), "hierarchical"),   # uneven datacenters after a node loss
    (("a", "b"), "flat"),
])
def test_layouts_match_single_process_training(dcs, strategy, single_process_losses):
    results = run_processes(_run, len(dcs), config(dcs, strategy))
    result, losses = results[0]
    assert len(losses) == 8
    assert losses == pytest.approx(single_process_losses, rel=2e-5)
    assert result.final_loss < result.first_loss


def test_loss_goes_down_and_cross_dc_bytes_are_counted():
    (result, losses), _ = run_processes(_run, 2, config(("a", "b"), steps=30))
    assert result.final_loss < result.first_loss - 0.5, (result.first_loss, result.final_loss)
    params = model_preset("nano").num_params
    # HAR with one rank per DC: each rank sends its whole (padded) buffer across, 2 ranks.
    assert result.inter_dc_bytes_per_step == pytest.approx(2 * params * 4, rel=0.01)


def _broadcasts_while_building(rank, world, cfg, epoch):
    """Build a replica of ``epoch`` on every rank; the broadcasts its build sent."""
    import torch
    import torch.distributed as dist

    from meridian.workers.loop.replica import DataParallelReplica, Membership

    calls = []
    real = dist.broadcast
    dist.broadcast = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    try:
        replica = DataParallelReplica(cfg, Membership(epoch=epoch, rank=rank, world_size=world,
                                                      datacenters=cfg.datacenters), torch.device("cpu"))
        replica.build()
    finally:
        dist.broadcast = real
    replica.close(ok=True)
    return len(calls)


def test_only_a_first_epoch_broadcasts_rank_0s_weights():
    """A re-formed epoch's restore sets every rank's weights, so its engine does not send rank 0's through the
    whole job (across the inter-DC link too); a first epoch's engine still does."""
    cfg = config(("a", "b"))
    assert min(run_processes(_broadcasts_while_building, 2, cfg, 1)) >= 1
    assert run_processes(_broadcasts_while_building, 2, cfg, 2) == [0, 0]
