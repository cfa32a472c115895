"""Error-feedback residuals survive a change of layout: what each datacenter still owes, per parameter element.

The engines save residuals by parameter element, each datacenter's apart, and cuts them into the new
layout's chunks on a resume. The existing tests resume into the same layout; here the full state pooled from
one layout (:func:`assemble`) is loaded into another with more or fewer ranks per datacenter, and the residuals
pooled back from the new ranks' shards must equal the saved ones exactly, for every datacenter: nothing owed is
lost, duplicated or moved to another element. HAR on FSDP2 and DiLoCo's outer deltas, int8, int4 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from sync_helpers import toy_model, train_steps

from meridian.workers.contracts.config import Compression, DiLoCoConfig, OptimConfig, SyncConfig, SyncStrategy
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.state.replica_state import FEEDBACK_KEY, assemble
from meridian.workers.sync.build import build_sync
from meridian.workers.sync.diloco import DiLoCoSync

OPTIM = OptimConfig(lr=0.05, grad_clip=0.5, warmup_steps=0)


def _engine(rank: int, dcs: tuple[str, ...], diloco: bool, compression: Compression):
    common = dict(compression=compression, inter_dc_chunk_mb=40 / 2**20)
    groups = DCGroups(DCLayout(dcs), rank)
    if diloco:
        sync = SyncConfig(strategy=SyncStrategy.DILOCO, diloco=DiLoCoConfig(inner_steps=2), **common)
        return DiLoCoSync(toy_model(0), groups, sync, OPTIM)
    return build_sync(toy_model(0), groups, SyncConfig(strategy=SyncStrategy.HIERARCHICAL, **common), OPTIM)


def _close(e):
    e.close()
    e.groups.destroy()


def _save(rank, world, dcs, diloco, compression):
    e = _engine(rank, dcs, diloco, compression)
    train_steps(e, rank, world, steps=4, micro=2)  # DiLoCo (H = 2): two outer syncs, none in flight at the end
    e.synchronize()
    out = e.local_shard(4)
    _close(e)
    return out


def _load(rank, world, dcs, diloco, compression, state):
    e = _engine(rank, dcs, diloco, compression)
    e.synchronize()
    e.load_optimizer_state(state)
    out = e.local_shard(4)
    _close(e)
    return out


@pytest.mark.parametrize("old, new, diloco, compression", [
    (("a", "a", "b", "b"), ("a", "b", "b"), True, Compression.INT4),     # DC a: 2 ranks -> 1
    (("a", "b"), ("a", "a", "a", "b", "b"), False, Compression.INT8),    # 1 -> 3 and 1 -> 2
    (("a", "a", "b"), ("a", "b"), False, Compression.BF16),              # 2 -> 1
])  # fmt: skip
def test_residuals_by_element_survive_a_change_of_layout(old, new, diloco, compression):
    shapes = {n: p.shape for n, p in toy_model(0).named_parameters()}
    _, state = assemble(run_processes(_save, len(old), old, diloco, compression), shapes)
    saved = state[FEEDBACK_KEY]["residuals"]
    assert sorted(saved) == ["a", "b"]
    assert all(any(bool(t.abs().max() > 0) for t in by_name.values()) for by_name in saved.values())
    _, again = assemble(run_processes(_load, len(new), new, diloco, compression, state), shapes)
    restored = again[FEEDBACK_KEY]["residuals"]
    assert sorted(restored) == sorted(saved)
    for dc, by_name in saved.items():
        assert sorted(restored[dc]) == sorted(by_name)
        for name, t in by_name.items():
            assert torch.equal(restored[dc][name], t), (dc, name)
