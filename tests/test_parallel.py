"""Tensor and pipeline parallelism on real multi-process gloo groups: every layout trains like one process.

Each layout trains the nano GPT on the same data from the same initial weights as a single process. The
loss curves must agree to 1e-4 relative and the final parameters to 1e-4 absolute (max over every
element): TP sums partial matmuls in another order and the clipping norm is summed in float64 across the
replica's ranks, so results may differ from one process by float32 rounding, never by a missing or
double-counted gradient (grad_clip=1.0 is active: the initial norm is well above 1).
"""

from __future__ import annotations

import pytest
import torch

from meridian.workers.contracts.config import (
    ParallelConfig,
    PipelineSchedule,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.contracts.rendezvous import Assignment
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.elastic.trainer import ElasticTrainer, ModelParallelNotElastic
from meridian.workers.loop.train import ListSink, train
from meridian.workers.parallel.dims import ParallelDims
from meridian.workers.parallel.tensor_parallel import assemble, shard, stage_layers, unshard

STEPS = 8


def _run(rank, world, cfg):
    sink = ListSink()
    result = train(cfg, sink=sink, keep_params=True)
    dims = ParallelDims(cfg.parallel.tp, cfg.parallel.pp, cfg.datacenters or ("local",) * world)
    return dims.coords(rank), result, [r.loss for r in sink.records], [r.grad_norm for r in sink.records]


def config(dcs, *, tp=1, pp=1, schedule="1f1b", strategy="hierarchical") -> TrainConfig:
    return TrainConfig(
        job_id="t", model=model_preset("nano"), steps=STEPS, global_batch=6, micro_batch=2, datacenters=dcs,
        sync=SyncConfig(strategy=SyncStrategy(strategy)), seed=1,
        parallel=ParallelConfig(tp=tp, pp=pp, schedule=PipelineSchedule(schedule)),
    )


@pytest.fixture(scope="module")
def single_process():
    (_, result, losses, norms), = run_processes(_run, 1, config(("a",)))
    assert norms[0] > 1.0  # clipping (grad_clip=1.0) acts, so a wrong norm would change the update
    return result, losses, norms


@pytest.mark.parametrize("dcs, tp, pp, schedule, strategy", [
    (("a", "a"), 2, 1, "1f1b", "hierarchical"),              # tp=2
    (("a", "a"), 1, 2, "1f1b", "hierarchical"),              # pp=2, one DC
    (("a", "b"), 1, 2, "gpipe", "hierarchical"),             # pp=2, a stage in each DC
    (("a", "a", "b", "b"), 2, 1, "1f1b", "hierarchical"),    # tp=2 inside each DC × dp=2 across DCs (HAR)
    (("a", "a", "b", "b"), 2, 1, "1f1b", "flat"),            # the same with DDP over each TP rank's DP group
    (("a", "b", "a", "b"), 1, 2, "1f1b", "hierarchical"),    # pp=2 × dp=2, replicas in different DCs
])
def test_layout_trains_like_one_process(dcs, tp, pp, schedule, strategy, single_process):
    ref, ref_losses, ref_norms = single_process
    cfg = config(dcs, tp=tp, pp=pp, schedule=schedule, strategy=strategy)
    out = run_processes(_run, len(dcs), cfg, timeout_s=180)
    losses, norms = out[0][2], out[0][3]
    assert len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert norms == pytest.approx(ref_norms, rel=1e-4)  # the norm summed over the replica's ranks
    assert out[0][1].eval_loss == pytest.approx(ref.eval_loss, rel=1e-4)
    full = assemble({(c.stage, c.tp_rank): r.final_params for c, r, _, _ in out if c.replica == 0})
    assert sorted(full) == sorted(ref.final_params)
    worst = max((full[n] - ref.final_params[n]).abs().max().item() for n in full)
    assert worst < 1e-4, worst
    # Replicas agree with each other exactly as the data-parallel sync promises.
    for c, r, _, _ in out:
        if c.replica:
            twin = next(r0 for c0, r0, _, _ in out if c0.replica == 0 and (c0.stage, c0.tp_rank) == (c.stage, c.tp_rank))
            for n, p in r.final_params.items():
                assert torch.equal(p, twin.final_params[n]), n


def test_shard_and_unshard_are_inverse():
    full = torch.arange(3 * 8 * 4, dtype=torch.float32).reshape(24, 4)
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight", "blocks.0.ln1.weight"):
        parts = [shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(unshard(name, parts), full)
    q_part = shard("blocks.0.attn.qkv.weight", full, 1, 2)
    assert torch.equal(q_part[:4], full[4:8])  # rank 1 holds the second half of q's rows (its heads)
    cols = [shard("blocks.0.mlp.proj.weight", full, r, 2) for r in range(2)]
    assert cols[0].shape == (24, 2) and torch.equal(unshard("blocks.0.mlp.proj.weight", cols), full)


def test_dims_place_ranks_and_refuse_tp_across_datacenters():
    dims = ParallelDims(2, 2, ("a",) * 4 + ("b",) * 4)
    assert dims.dp == 2
    assert dims.coords(5).__dict__ == {"stage": 1, "replica": 0, "tp_rank": 1}
    assert dims.dp_ranks(1, 1) == (5, 7)
    assert dims.stage_neighbours(1) == (None, 5)
    assert [len(stage_layers(5, 2, s)) for s in range(2)] == [3, 2]
    with pytest.raises(ValueError, match="tensor parallelism must stay inside one node"):
        ParallelDims(2, 1, ("a", "b"))
    with pytest.raises(ValueError, match="'flat' cannot run with parallelism.pp > 1"):
        config(("a", "a"), pp=2, strategy="flat")
    with pytest.raises(ValueError, match=r"parallelism.tp \(3\) must divide model.n_heads"):
        config(("a",) * 3, tp=3)


# -- the same loop under the elastic trainer -------------------------------------------------------------------


class _FormedRendezvous:
    """Epoch ``epoch`` over the default group that ``run_processes`` already formed: nothing to host or join."""

    def __init__(self, rank, world, cfg, epoch=1, resume_step=0):
        self.epoch = 0
        self.a = Assignment(epoch=epoch, rank=rank, world_size=world, datacenters=cfg.datacenters, master_addr="",
                            master_port=0, resume_step=resume_step, from_checkpoint=False,
                            newcomer_ranks=tuple(range(world)))  # fmt: skip

    def join(self, *, last_step, timeout_s, snapshot_every=1):
        return self.a

    def form(self, a):
        pass

    def finish(self):
        pass


def _plain_then_elastic(rank, world, cfg):
    plain, elastic = ListSink(), ListSink()
    train(cfg, sink=plain)
    ElasticTrainer(cfg, _FormedRendezvous(rank, world, cfg), sink=elastic, on_event=lambda *e: None).run()
    return plain.records, elastic.records


def test_the_elastic_trainer_runs_a_model_parallel_job_through_the_same_loop():
    plain, elastic = run_processes(_plain_then_elastic, 2, config(("a", "b"), pp=2), timeout_s=180)[0]
    assert [r.loss for r in elastic] == [r.loss for r in plain] and len(plain) == STEPS
    assert {r.epoch for r in plain} == {0} and {r.epoch for r in elastic} == {1}


def test_a_model_parallel_job_refuses_to_resume_after_losing_a_worker():
    cfg = config(("a", "a"), tp=2)
    trainer = ElasticTrainer(cfg, _FormedRendezvous(0, 2, cfg, epoch=2, resume_step=3), sink=ListSink(),
                             on_event=lambda *e: None)  # fmt: skip
    with pytest.raises(ModelParallelNotElastic, match="cannot resume after losing a worker yet"):
        trainer.run()
