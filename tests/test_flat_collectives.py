"""The flat-tensor collectives run on a torch that has only their old names (torch < 2.13: the GPU image's 2.11
failed every multi-rank job's first step on ``dist.reduce_scatter_single``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meridian.bench.engine_ceiling import use_in_dc
from meridian.workers.distributed import flat_collectives
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.sync.har import hierarchical_all_reduce
from meridian.workers.sync.inter_dc import InterDCComm


def _har_with_only_the_old_names(rank: int, world: int) -> dict:
    calls = {"reduce_scatter_tensor": 0, "all_gather_into_tensor": 0}
    for new, old in (("reduce_scatter_single", "reduce_scatter_tensor"), ("all_gather_single", "all_gather_into_tensor")):
        real = getattr(dist, new, None) or getattr(dist, old)  # from 2.13 the old names only warn and call the new

        def counted(*args, _real=real, _old=old, **kwargs):
            calls[_old] += 1
            return _real(*args, **kwargs)

        if hasattr(dist, new):
            delattr(dist, new)  # this interpreter is the rank's own: nothing else sees the change
        setattr(dist, old, counted)
    use_in_dc("collectives")  # the in-DC collectives, as a GPU rank runs them (CPU ranks go direct)
    groups = DCGroups(DCLayout(("a", "a", "b", "b")), rank)
    buf = torch.randint(-8, 9, (4 * groups.layout.units * 3,), generator=torch.Generator().manual_seed(rank)).float()
    flat = buf.clone()
    dist.all_reduce(flat)
    hierarchical_all_reduce(buf, groups, InterDCComm())
    groups.destroy()
    return {"equal": torch.equal(buf, flat), **calls}


def test_hierarchical_all_reduce_on_a_torch_with_only_the_old_names():
    for r in run_processes(_har_with_only_the_old_names, 4):
        assert r["equal"]
        assert r["reduce_scatter_tensor"] == 1 and r["all_gather_into_tensor"] == 1


def test_a_torch_with_neither_name_is_named_in_the_error(monkeypatch):
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_tensor")
    with pytest.raises(RuntimeError, match="reduce_scatter_single, reduce_scatter_tensor"):
        flat_collectives.reduce_scatter_single(torch.zeros(1), torch.zeros(2))
