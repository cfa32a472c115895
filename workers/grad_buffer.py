"""Contiguous gradient buckets whose views are the parameters' ``.grad``.

Parameters are grouped in reverse registration order (about the order backward produces their gradients)
into buckets of roughly ``bucket_mb``. Each bucket is one flat fp32 tensor, padded to a multiple of the
layout's unit count so every datacenter can cut it into equal shards (:mod:`meridian.workers.layout`).
Each parameter's ``.grad`` is a view into its bucket (DDP's ``gradient_as_bucket_view``): autograd
accumulates micro-batches straight into the buffer and the collectives run on it without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ParamSlot:
    """Where one parameter lives inside its bucket: elements ``[offset, offset + numel)``."""

    name: str
    param: nn.Parameter
    offset: int

    @property
    def numel(self) -> int:
        return self.param.numel()


@dataclass
class Bucket:
    index: int
    grad: torch.Tensor  # flat, padded: (padded_numel,)
    slots: list[ParamSlot] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements that hold gradients (without the padding)."""
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.grad.numel()


class GradBuffer:
    """All trainable parameters of a model, bucketed, with ``.grad`` as views into the buckets."""

    def __init__(self, model: nn.Module, *, bucket_mb: float, pad_to: int, dtype: torch.dtype = torch.float32) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        device = named[0][1].device
        cap = max(1, int(bucket_mb * 2**20) // torch.empty(0, dtype=dtype).element_size())
        groups: list[list[tuple[str, nn.Parameter]]] = [[]]
        size = 0
        for name, p in reversed(named):
            if groups[-1] and size + p.numel() > cap:
                groups.append([])
                size = 0
            groups[-1].append((name, p))
            size += p.numel()
        self.buckets: list[Bucket] = []
        for i, members in enumerate(groups):
            numel = sum(p.numel() for _, p in members)
            padded = -(-numel // pad_to) * pad_to
            bucket = Bucket(index=i, grad=torch.zeros(padded, dtype=dtype, device=device))
            offset = 0
            for name, p in members:
                bucket.slots.append(ParamSlot(name, p, offset))
                offset += p.numel()
            self.buckets.append(bucket)
        self.attach_grads()

    def attach_grads(self) -> None:
        """Point every parameter's ``.grad`` at its slice of the bucket (again, after a load)."""
        for bucket in self.buckets:
            for s in bucket.slots:
                s.param.grad = bucket.grad[s.offset : s.offset + s.numel].view_as(s.param)

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.grad.zero_()

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)
