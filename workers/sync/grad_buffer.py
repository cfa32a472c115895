"""Contiguous gradient buckets whose views are the parameters' ``.grad`` (and, optionally, their data).

Parameters are grouped in reverse registration order (about the order backward produces their gradients)
into buckets of roughly ``bucket_mb``; a bucket holds one dtype, the dtype of its parameters, so fp32,
bf16 and fp16 models all get gradients of their own precision. Each bucket is one flat tensor, padded to
a multiple of the layout's unit count so every datacenter can cut it into equal shards
(:mod:`meridian.workers.distributed.layout`). Each parameter's ``.grad`` is a view into its bucket (DDP's
``gradient_as_bucket_view``): autograd accumulates micro-batches straight into the buffer and the
collectives run on it without a copy.

:meth:`GradBuffer.flatten_params` does the same for the parameters' data, with the same layout, so the
sharded optimizer can all-gather updated parameters in place. This module never communicates.
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

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass
class Bucket:
    index: int
    grad: torch.Tensor  # flat, padded: (padded_numel,), the parameters' dtype
    slots: list[ParamSlot] = field(default_factory=list)
    data: torch.Tensor | None = None  # flat parameter values, same layout; set by flatten_params()

    @property
    def numel(self) -> int:
        """Elements that hold gradients (without the padding, which sits at the end)."""
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.grad.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.grad.dtype


class GradBuffer:
    """All trainable parameters of a model, bucketed, with ``.grad`` as views into the buckets."""

    def __init__(self, model: nn.Module, *, bucket_mb: float, pad_to: int) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"all parameters must live on one device, found {sorted(map(str, devices))}")
        device = named[0][1].device
        cap_bytes = max(1, int(bucket_mb * 2**20))
        groups: list[list[tuple[str, nn.Parameter]]] = [[]]
        size = 0
        for name, p in reversed(named):
            nbytes = p.numel() * p.element_size()
            if groups[-1] and (size + nbytes > cap_bytes or groups[-1][0][1].dtype != p.dtype):
                groups.append([])
                size = 0
            groups[-1].append((name, p))
            size += nbytes
        self.buckets: list[Bucket] = []
        for i, members in enumerate(groups):
            numel = sum(p.numel() for _, p in members)
            padded = -(-numel // pad_to) * pad_to
            bucket = Bucket(index=i, grad=torch.zeros(padded, dtype=members[0][1].dtype, device=device))
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
                s.param.grad = bucket.grad[s.offset : s.stop].view_as(s.param)

    def flatten_params(self) -> None:
        """Move every parameter's data into a flat per-bucket tensor (``Bucket.data``) and view it from there.

        Values are unchanged. Later in-place writes to ``Bucket.data`` (an all-gather) are the parameters'
        new values; ``model.load_state_dict`` copies in place and keeps the views.
        """
        for bucket in self.buckets:
            if bucket.data is not None:
                continue
            bucket.data = torch.zeros_like(bucket.grad)
            for s in bucket.slots:
                bucket.data[s.offset : s.stop].copy_(s.param.detach().reshape(-1))
                s.param.data = bucket.data[s.offset : s.stop].view_as(s.param)

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.grad.zero_()

    @property
    def slots(self) -> list[ParamSlot]:
        return [s for b in self.buckets for s in b.slots]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)
