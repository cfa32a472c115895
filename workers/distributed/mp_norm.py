"""The global gradient norm when one model replica is split over several ranks (tensor/pipeline parallel).

Clipping must see the norm of the *whole* gradient, as single-process training does. With tensor and
pipeline parallelism each rank holds part of it: pipeline stages hold different layers, tensor-parallel
ranks hold slices of the attention/MLP matrices and identical copies of everything else (norms, the
row-parallel biases). So each rank sums the squares of what it holds, counting a parameter every TP rank
holds whole on TP rank 0 only, and the sums are added over the replica's ranks (the *model-parallel* group,
one rank per pipeline stage and TP rank).

Never talks to the data-parallel groups: the engine calls :meth:`ModelParallelNorm.total` after its own
datacenter-level reductions (:class:`~meridian.workers.sync.shard_exchange.NormPlan`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ModelParallelNorm:
    group: dist.ProcessGroup
    """Every rank holding a part of this rank's model replica (tp × pp ranks), in (stage, TP rank) order."""
    tp_rank: int = 0
    """This rank's tensor-parallel rank: only rank 0 counts what every TP rank holds whole."""
    counted: Callable[[str], bool] | None = None
    """For the flat-bucket engines: whether this rank counts parameter ``name``."""

    def total(self, sumsq: torch.Tensor) -> torch.Tensor:
        """The replica's sum of squares from this rank's (a float64 scalar): one entry per rank of the group, each
        filled by its rank alone, added in rank order, so every datacenter's replica adds the same numbers in the
        same order and gets the same bits."""
        n = dist.get_world_size(self.group)
        entries = torch.zeros(n, dtype=torch.float64, device=sumsq.device)
        entries[dist.get_rank(self.group)] = sumsq.detach().to(torch.float64)
        dist.all_reduce(entries, group=self.group)
        return entries.sum()

    def reduce(self, sumsq: torch.Tensor) -> torch.Tensor:
        """Sum of squares over the replica, from this rank's share (a float64 scalar)."""
        total = sumsq.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total[0]


def clip_grad_norm(
    named: Iterable[tuple[str, nn.Parameter]], max_norm: float, mp: ModelParallelNorm | None
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole replica; returns the norm before clipping."""
    named = [(n, p) for n, p in named if p.grad is not None]
    limit = max_norm if max_norm > 0 else float("inf")
    if mp is None:
        return torch.nn.utils.clip_grad_norm_([p for _, p in named], limit)
    assert mp.counted is not None
    device = named[0][1].grad.device if named else torch.device("cpu")
    sumsq = torch.zeros((), dtype=torch.float64, device=device)
    for name, p in named:
        if mp.counted(name):
            sumsq += p.grad.detach().double().square().sum()
    norm = mp.reduce(sumsq).sqrt().float()
    if max_norm > 0:
        # Same formula as torch.nn.utils.clip_grad_norm_.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, p in named:
            p.grad.detach().mul_(coef.to(p.grad.device))
    return norm
