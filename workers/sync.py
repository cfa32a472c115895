"""Gradient-sync engines: how the data-parallel replicas agree on one update per step.

Call order inside a training step (every rank)::

    for i, (x, y) in enumerate(micro_batches):
        loss = local_loss_sum(x, y) / global_batch      # this rank's share of the global mean
        engine.backward(loss, last_micro_batch=i == len(micro_batches) - 1)
    stats = engine.step(lr)                             # sync, clip, AdamW, parameters equal everywhere

The loss each rank passes is its *share* of the global-batch mean, so summing gradients over ranks gives
exactly the single-process gradient however the samples are split (uneven shares included).

- :class:`FlatSync`: PyTorch DDP over all ranks, as Ray Train's ``prepare_model`` sets it up.
- :class:`HierarchicalSync`: bucketed hierarchical all-reduce (:mod:`meridian.workers.har`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meridian.workers.config import OptimConfig, SyncConfig
from meridian.workers.grad_buffer import GradBuffer
from meridian.workers.har import hierarchical_all_reduce
from meridian.workers.layout import DCGroups
from meridian.workers.model import decay_mask


@dataclass(frozen=True)
class StepStats:
    grad_norm: float
    """Global gradient norm before clipping."""
    inter_dc_bytes: int
    """Tensor bytes this rank put into collectives that cross a datacenter boundary this step."""
    sync_wait_s: float
    """Seconds ``step`` spent waiting for communication (the part not hidden behind compute)."""


def build_adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    mask = decay_mask(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if mask[n]], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if not mask[n]], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False,
    )


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Make every replica start from rank ``src``'s weights."""
    for p in model.parameters():
        dist.broadcast(p.data, src=src)


class GradientSync(ABC):
    """One data-parallel replica's side of the step: backward, sync, update."""

    model: nn.Module

    @abstractmethod
    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None: ...

    @abstractmethod
    def step(self, lr: float) -> StepStats: ...

    @abstractmethod
    def optimizer_state(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class FlatSync(GradientSync):
    """Plain DDP: one all-reduce of every gradient bucket over all ranks, overlapped with backward."""

    def __init__(self, model: nn.Module, groups: DCGroups, sync: SyncConfig, optim: OptimConfig) -> None:
        self.groups = groups
        self.optim_cfg = optim
        self.model = DistributedDataParallel(model, bucket_cap_mb=sync.bucket_mb, gradient_as_bucket_view=True)
        self.optimizer = build_adamw(self.model.module, optim)
        self._cross_dc = groups.num_dcs > 1
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        # DDP averages over ranks; our loss is this rank's share of the global mean, so undo the average.
        scaled = loss * dist.get_world_size()
        if last_micro_batch:
            scaled.backward()
        else:
            with self.model.no_sync():
                scaled.backward()

    def step(self, lr: float) -> StepStats:
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.optim_cfg.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        _set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        # DDP's all-reduce spans every rank: with several DCs all of it crosses a DC boundary.
        return StepStats(float(norm), self._grad_bytes if self._cross_dc else 0, 0.0)

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class HierarchicalSync(GradientSync):
    """Bucketed HAR after backward, then a replicated AdamW step on the full gradient."""

    def __init__(self, model: nn.Module, groups: DCGroups, sync: SyncConfig, optim: OptimConfig) -> None:
        self.groups = groups
        self.optim_cfg = optim
        self.model = model
        broadcast_parameters(model)
        self.buffer = GradBuffer(model, bucket_mb=sync.bucket_mb, pad_to=groups.layout.units)
        self.optimizer = build_adamw(model, optim)

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        loss.backward()

    def step(self, lr: float) -> StepStats:
        t0 = time.perf_counter()
        sent = sum(hierarchical_all_reduce(b.grad, self.groups) for b in self.buffer.buckets)
        wait = time.perf_counter() - t0
        params = [s.param for b in self.buffer.buckets for s in b.slots]
        clip = self.optim_cfg.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        _set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.buffer.zero()
        return StepStats(float(norm), sent, wait)

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def build_sync(model: nn.Module, groups: DCGroups, sync: SyncConfig, optim: OptimConfig) -> GradientSync:
    if sync.strategy.value == "flat":
        return FlatSync(model, groups, sync, optim)
    return HierarchicalSync(model, groups, sync, optim)
