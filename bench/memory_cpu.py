"""``meridian bench memory --cpu-layouts``: each rank's peak tensor bytes in one training step of a multi-rank
layout on CPU (gloo), counted from the live storages, against the planner's per-rank figure for the same layout.

Each layout runs as processes on this host (:func:`meridian.workers.distributed.multiproc.run_processes`), through
the FSDP2 engine the workers run (:class:`meridian.workers.sync.fsdp_har.FSDPHierarchicalSync`: sharded inside a
datacenter, summed across datacenters), in fp32. After a warm-up step (which creates the AdamW state) each rank
runs its second step under :class:`LiveStorages`, a ``TorchDispatchMode`` that sums the bytes of every live tensor
storage after each operator; the measured figure is that sum's maximum. Buffers an operator allocates and frees
inside itself are not seen. The same rank's peak RSS growth over the run, with glibc's mmap threshold at 64 KiB so
freed tensors' pages go back to the system, is the cross-check (it also holds the interpreter, torch and gloo)
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@dataclass(frozen=True)
class CpuLayout:
    name: str
    dcs: tuple[str, ...]
    """Each rank's datacenter."""
    checkpointing: str = "none"
    """Activation checkpointing per block: ``none`` or ``full``."""


LAYOUTS = (
    CpuLayout("fsdp-4", ("a",) * 4),
    CpuLayout("hsdp-2x2", ("a", "a", "b", "b")),
    CpuLayout("fsdp-4-full-ckpt", ("a",) * 4, "full"),
)


def model_config(seq_len: int):
    """A ~20M-parameter Llama-style model (10 blocks, width 512, vocabulary 4096)."""
    from meridian.workers.contracts.model_config import ModelFamily, model_preset

    return replace(model_preset("llama-tiny"), family=ModelFamily.LLAMA, n_layers=10, d_model=512, n_heads=8,
                   n_kv_heads=8, vocab_size=4096, seq_len=seq_len)  # fmt: skip


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class LiveStorages(TorchDispatchMode):
    """Live tensor storage bytes, checked after every operator: each storage alive when the mode starts (found
    through the garbage collector) and each one an operator returns, held by a weak reference and counted at its
    current size (FSDP2 resizes its gathered weights' storages in place) until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), DTensor):
                self._track(obj)
        self.at_start = self.peak = self.live()

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass or a tensor with no storage
            return
        key = storage._cdata
        ref = self.refs.get(key)
        if ref is None or ref.expired():
            self.refs[key] = StorageWeakRef(storage)

    def live(self) -> int:
        total, dead = 0, []
        for key, ref in self.refs.items():
            storage = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                dead.append(key)
            else:
                total += storage.nbytes()
        for key in dead:
            del self.refs[key]
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak = max(self.peak, self.live())
        return out


def _rank(rank: int, world: int, layout: CpuLayout, micro_batch: int, seq_len: int) -> dict[str, Any]:
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 16)
    import torch.distributed as dist

    from meridian.workers.contracts.config import ActivationCheckpointing, OptimConfig, SyncConfig
    from meridian.workers.distributed.layout import DCGroups, DCLayout
    from meridian.workers.model.build import build_model
    from meridian.workers.parallel.checkpointing import apply_activation_checkpointing
    from meridian.workers.parallel.fsdp import transformer_blocks
    from meridian.workers.sync.fsdp_har import FSDPHierarchicalSync

    cfg = model_config(seq_len)
    groups = DCGroups(DCLayout(layout.dcs), rank, segment_groups=False)
    optim = OptimConfig(lr=1e-3, warmup_steps=0)
    rss_before = _rss_bytes()
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_activation_checkpointing(transformer_blocks(model), ActivationCheckpointing(layout.checkpointing))
    engine = FSDPHierarchicalSync(model, groups, SyncConfig(), optim)
    global_batch = micro_batch * world
    counter = None
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, cfg.vocab_size, (global_batch, seq_len + 1), generator=g)
        rows = x[rank * micro_batch:(rank + 1) * micro_batch]
        xs, ys = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        del g, x, rows
        gc.collect()
        counter = LiveStorages() if step == 1 else None
        with counter if counter is not None else contextlib.nullcontext():
            with engine.micro_batch(last_micro_batch=True):
                losses = engine.model(xs, ys)  # each sample's mean loss
                share = losses.sum() / global_batch
                engine.backward(share, last_micro_batch=True)
            engine.step(optim.lr)
            del losses, share
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert counter is not None
    at_start, peak, n = counter.at_start, counter.peak, len(counter.refs)
    out = {"rank": rank, "dc": layout.dcs[rank], "live_at_step_start_bytes": at_start, "peak_bytes": peak,
           "storages_tracked": n, "rss_growth_bytes": rss_peak - rss_before,
           "params": sum(p.numel() for p in model.parameters()),
           "optimizer_state_bytes": engine.optimizer_state_nbytes(),
           "exchange_buffer_bytes": engine.exchange_buffer_nbytes()}
    dist.barrier()
    engine.close()
    groups.destroy()
    return out


def planner_estimate(layout: CpuLayout, micro_batch: int, seq_len: int) -> float:
    """The planner's per-rank bytes for ``layout`` (FSDP inside each datacenter, fp32 weights and compute)."""
    from meridian.service.planning.cost_model import Layout, Recompute, memory_per_device

    world, num_dcs = len(layout.dcs), len(set(layout.dcs))
    lay = Layout(tp=1, pp=1, dp=world, num_dcs=num_dcs, dp_per_dc=world // num_dcs, pp_spans_dcs=False,
                 micro_batch=micro_batch, micro_batches=1, hierarchical=True, overlap=True,
                 fp32=True, fsdp=True, bf16_weights=False, recompute=Recompute(layout.checkpointing))
    return memory_per_device(model_config(seq_len), lay)


def measure(layout: CpuLayout, micro_batch: int, seq_len: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """One layout's ranks: each rank's measured peak, the largest, the planner's figure and the ratio."""
    from meridian.workers.distributed.multiproc import run_processes

    ranks = run_processes(_rank, len(layout.dcs), layout, micro_batch, seq_len, timeout_s=timeout_s)
    peak = max(r["peak_bytes"] for r in ranks)
    estimate = planner_estimate(layout, micro_batch, seq_len)
    return {"layout": layout.name, "ranks": len(layout.dcs), "datacenters": len(set(layout.dcs)),
            "activation_checkpointing": layout.checkpointing, "micro_batch": micro_batch, "seq_len": seq_len,
            "params": ranks[0]["params"], "measured_peak_bytes": peak, "estimate_bytes": estimate,
            "estimate_over_measured": estimate / peak,
            "rss_growth_over_peak": max(r["rss_growth_bytes"] for r in ranks) / peak, "per_rank": ranks}


def run(micro_batch: int, seq_len: int, names: list[str] | None = None) -> dict[str, Any]:
    import os
    import platform

    chosen = [lay for lay in LAYOUTS if names is None or lay.name in names]
    unknown = set(names or ()) - {lay.name for lay in LAYOUTS}
    if unknown:
        raise ValueError(f"unknown CPU layouts {sorted(unknown)}: use {[lay.name for lay in LAYOUTS]}")
    return {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "precision": "fp32",
            "rows": [measure(lay, micro_batch, seq_len) for lay in chosen]}
