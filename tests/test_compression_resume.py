"""Compressed inter-DC sync resumes from a durable checkpoint as if never stopped: the error-feedback residuals
(what int8/bf16 rounding has not yet sent) are saved with each rank's state and put back.

End to end, hierarchical sync with int8 (and bf16) compression: a run resumed from its step-6 checkpoint
must give the uninterrupted run's losses and final parameters bit for bit, with a two-rank DC and with one rank
per DC (the full, pooled state's load path: ``tests/test_feedback_across_layouts.py``). A resume that restarted the
residuals at zero changes the step after it. DiLoCo's compressed outer deltas cannot be checked that way (its
checkpoint keeps one DC's inner state, so even an uncompressed DiLoCo resume differs), so there the residuals
themselves must come back from the checkpoint exactly, in both load paths.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from sync_helpers import toy_model, train_steps
from test_parallel import _FormedRendezvous

from meridian.workers.contracts.config import (
    Compression,
    DiLoCoConfig,
    OptimConfig,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.elastic.trainer import ElasticTrainer
from meridian.workers.loop.train import ListSink
from meridian.workers.state import storage
from meridian.workers.state.sharded_checkpoint import open_checkpoint, read_ranges, save_shard
from meridian.workers.sync.diloco import DiLoCoSync

STEPS = 8


def _train(rank, world, cfg):
    sink = ListSink()
    trainer = ElasticTrainer(cfg, _FormedRendezvous(rank, world, cfg), sink=sink, on_event=lambda *e: None,
                             keep_params=True)  # fmt: skip
    return trainer.run().final_params, [(r.step, r.loss) for r in sink.records]


def _drop_latest_checkpoint(directory: str) -> int:
    """Make the checkpoint before the last one the latest; returns its step."""
    steps = sorted(n for n in os.listdir(directory) if n.startswith("step-"))
    shutil.rmtree(os.path.join(directory, steps[-1]))
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write(steps[-2])
    return int(steps[-2].removeprefix("step-"))


@pytest.mark.parametrize("dcs, compression", [
    (("a", "a", "b"), Compression.INT8),    # two ranks in DC a, one in b
    (("a", "b"), Compression.INT8),         # one rank per DC: each holds its DC's whole state
    (("a", "b", "b"), Compression.BF16),
])
def test_a_compressed_run_resumed_from_a_checkpoint_matches_the_uninterrupted_run(tmp_path, dcs, compression):
    cfg = TrainConfig(
        job_id="t", model=model_preset("nano"), steps=STEPS, global_batch=4, micro_batch=2, datacenters=dcs, seed=1,
        checkpoint_dir=str(tmp_path), checkpoint_every=3, optim=OptimConfig(warmup_steps=2, lr=3e-3),
        sync=SyncConfig(strategy=SyncStrategy.HIERARCHICAL, compression=compression),
    )
    full = run_processes(_train, len(dcs), cfg, timeout_s=180)
    resumed_at = _drop_latest_checkpoint(str(tmp_path))
    resumed = run_processes(_train, len(dcs), cfg, timeout_s=180)
    assert 0 < resumed_at < STEPS
    losses, losses2 = full[0][1], resumed[0][1]  # rank 0 records the job's losses
    assert [s for s, _ in losses2] == list(range(resumed_at + 1, STEPS + 1))
    assert losses2 == losses[resumed_at:]  # exactly: float equality, not a tolerance
    for (params, _), (params2, _) in zip(full, resumed, strict=True):
        for name, p in params.items():
            assert torch.equal(p, params2[name]), name


# -- DiLoCo: the outer deltas' residuals through a checkpoint ----------------------------------------------------


def _residuals(engine: DiLoCoSync) -> dict:
    """Every residual the engine's outer sync holds, by (unit, fragment, owners, chunk)."""
    out = {}
    for seg, key in engine.chunk_keys():
        r = engine.comm.residual(seg, key)
        if r is not None:
            out[(seg.lo, seg.hi, seg.owners, key)] = r.clone()
    return out


def _diloco_round_trip(rank, world, dcs, directory):
    sync = SyncConfig(strategy=SyncStrategy.DILOCO, compression=Compression.INT8, inter_dc_chunk_mb=40 / 2**20,
                      diloco=DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9))  # fmt: skip
    optim = OptimConfig(lr=0.05, grad_clip=0.5, warmup_steps=0)
    groups = DCGroups(DCLayout(dcs), rank)
    engine = DiLoCoSync(toy_model(0), groups, sync, optim)
    train_steps(engine, rank, world, steps=4, micro=2)
    saved = _residuals(engine)
    shapes = {n: p.shape for n, p in engine.model.named_parameters()}
    save_shard(directory, engine.local_shard(4), rank=rank, datacenter=dcs[rank], shapes=shapes, fingerprint={})
    torch.distributed.barrier()

    again = DiLoCoSync(toy_model(1), groups, sync, optim)
    assert _residuals(again) == {}
    ck = open_checkpoint(os.path.join(directory, storage.latest(directory)))
    again.load_local_shard(read_ranges(ck, again.owned_ranges()))
    restored = _residuals(again)
    for e in (engine, again):
        e.close()
    groups.destroy()
    return saved, restored


@pytest.mark.parametrize("dcs", [("a", "a", "b"), ("a", "b")])
def test_diloco_outer_residuals_come_back_from_a_checkpoint(tmp_path, dcs):
    for saved, restored in run_processes(_diloco_round_trip, len(dcs), dcs, str(tmp_path)):
        assert saved and sorted(saved) == sorted(restored)
        assert any(bool(r.abs().max() > 0) for r in saved.values())  # int8 left something to carry
        for key, r in saved.items():
            assert torch.equal(r, restored[key]), key



def _snapshot_and_checkpoint_shards(rank, world, dcs):
    from sync_helpers import lr_of, micro_batches, share_loss

    from meridian.workers.sync.build import build_sync

    sync = SyncConfig(strategy=SyncStrategy.HIERARCHICAL, compression=Compression.INT8, bucket_mb=64 / 2**20)
    groups = DCGroups(DCLayout(dcs), rank)
    engine = build_sync(toy_model(0), groups, sync, OptimConfig(lr=0.05, warmup_steps=0))
    batches = micro_batches(0, rank, world, 64)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        with engine.micro_batch(last_micro_batch=last):
            engine.backward(share_loss(engine.model, x, y), last_micro_batch=last)
    snapshot = engine.step(lr_of(0), snapshot_as=1).shard
    checkpoint = engine.local_shard(1)
    held = engine.feedback_held
    engine.close()
    groups.destroy()
    return held, len(snapshot.feedback), len(checkpoint.feedback)


def test_step_snapshots_leave_the_residuals_out_and_a_checkpoint_s_shard_has_them():
    # A snapshot is taken every step and does not keep the residuals: copying them there cost a host copy of the
    # rank's shard per step for nothing. A durable checkpoint reads local_shard, which has them.
    for held, in_snapshot, in_checkpoint in run_processes(_snapshot_and_checkpoint_shards, 2, ("a", "b"), timeout_s=120):
        assert held and in_snapshot == 0 and in_checkpoint == 1
