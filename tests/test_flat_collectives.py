"""The flat-tensor all-gather runs on a torch that has only its old name (torch < 2.13: the GPU image's 2.11 failed
every multi-rank job's first step on the new names)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meridian.workers.contracts.config import Compression
from meridian.workers.distributed import flat_collectives
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.sync.inter_dc import InterDCComm


def _int8_sum_with_only_the_old_name(rank: int, world: int) -> dict:
    """int8's inter-DC sum over three datacenters all-gathers the encoded payloads (two exchange them): through the
    old name when it is the only one."""
    calls = {"all_gather_into_tensor": 0}
    real = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # from 2.13 the old name warns

    def counted(*args, **kwargs):
        calls["all_gather_into_tensor"] += 1
        return real(*args, **kwargs)

    if hasattr(dist, "all_gather_single"):
        delattr(dist, "all_gather_single")  # this interpreter is the rank's own: nothing else sees the change
    dist.all_gather_into_tensor = counted
    groups = DCGroups(DCLayout(("a", "b", "c")), rank)
    ((seg, group),) = groups.inter_dc.items()
    values = torch.randint(-8, 9, (64,), generator=torch.Generator().manual_seed(rank)).float()
    total = values.clone()
    dist.all_reduce(total)
    out = values.clone()
    InterDCComm(Compression.INT8).all_reduce_async(out, group, seg, key=0).wait()
    groups.destroy()
    return {"close": bool((out - total).abs().max() <= 0.05 * total.abs().max()), **calls}


def test_the_compressed_inter_dc_sum_on_a_torch_with_only_the_old_name():
    for r in run_processes(_int8_sum_with_only_the_old_name, 3):
        assert r["close"] and r["all_gather_into_tensor"] >= 1


def test_a_torch_with_neither_name_is_named_in_the_error(monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "all_gather_into_tensor")
    with pytest.raises(RuntimeError, match="all_gather_single, all_gather_into_tensor"):
        flat_collectives.all_gather_single(torch.zeros(2), torch.zeros(1))
