"""The ``flat`` strategy: PyTorch DDP over every rank, as Ray Train's ``prepare_model`` sets it up.

One all-reduce per gradient bucket over all ranks, overlapped with backward by DDP itself. The baseline the
hierarchical engine is measured against; it ignores ``overlap`` (DDP always overlaps; it never shards) and has
no compression. Across datacenters its all-reduce goes through
:func:`meridian.workers.wan.collectives.flat_ddp_comm_hook`, which counts the bytes each bucket's ring puts
across a DC boundary (and, under an emulated WAN, delays the result to the emulated link's pace).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meridian.workers.contracts.config import OptimConfig, SyncConfig
from meridian.workers.distributed.layout import DCGroups
from meridian.workers.distributed.mp_norm import clip_grad_norm
from meridian.workers.optim.adamw import build_adamw, full_state_of, load_full_state, set_lr, state_nbytes
from meridian.workers.state.replica_state import LocalShard, replicated_shard
from meridian.workers.sync.engine import GradientSync, StepStats
from meridian.workers.wan.collectives import FlatHookState, flat_ddp_comm_hook
from meridian.workers.wan.emulator import WanEmulator


class FlatSync(GradientSync):
    """Plain DDP: one all-reduce of every gradient bucket over all ranks, overlapped with backward."""

    def __init__(
        self,
        model: nn.Module,
        groups: DCGroups,
        sync: SyncConfig,
        optim: OptimConfig,
        *,
        emulator: WanEmulator | None = None,
    ) -> None:
        self.groups = groups
        self.optim_cfg = optim
        # groups.world: the data-parallel ranks (all ranks unless tensor/pipeline parallelism splits replicas).
        self.model = DistributedDataParallel(
            model, bucket_cap_mb=sync.bucket_mb, gradient_as_bucket_view=True, process_group=groups.world
        )
        self._hook: FlatHookState | None = None
        if groups.num_dcs > 1:
            # DDP's own all-reduce, counted bucket by bucket (what this rank's ring edge carries across a DC
            # boundary) and, with an emulator, completed when the emulated WAN would deliver a ring all-reduce.
            group_ranks = tuple(range(groups.layout.world_size))  # layout indices, as the emulator's layout
            emu = emulator if emulator is not None and emulator.enabled else None
            self._hook = FlatHookState(emu, groups.world, group_ranks, dc_layout=groups.layout)
            self.model.register_comm_hook(self._hook, flat_ddp_comm_hook)
        self.optimizer = build_adamw(self.model.module, optim)

    def micro_batch(self, *, last_micro_batch: bool) -> AbstractContextManager[object]:
        # DDP decides in forward whether the next backward all-reduces. Run forward outside no_sync and
        # every micro-batch is all-reduced; ranks with different micro-batch counts then hang (measured).
        return nullcontext() if last_micro_batch else self.model.no_sync()

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        # DDP averages over ranks; our loss is this rank's share of the global mean, so undo the average.
        (loss * dist.get_world_size(self.groups.world)).backward()

    def step(self, lr: float, *, snapshot_as: int | None = None, last: bool = False) -> StepStats:
        norm = clip_grad_norm(self._named(), self.optim_cfg.grad_clip, self.groups.mp_norm)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        # What DDP's ring put on this rank's outgoing edge, when that edge joins two DCs (0 for the others).
        sent = round(self._hook.sent.reset().wire_bytes) if self._hook is not None else 0
        return StepStats(
            grad_norm=norm.detach(),
            inter_dc_bytes=sent,
            sync_wait_s=0.0,
            shard=None if snapshot_as is None else self.local_shard(snapshot_as),
        )

    def local_shard(self, step: int) -> LocalShard:
        return replicated_shard(self.optimizer, self._named(), step)

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.module.named_parameters() if p.requires_grad]

    def optimizer_state(self) -> dict[str, Any]:
        return full_state_of(self.optimizer, self._named())

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        load_full_state(self.optimizer, self._named(), state)

    def optimizer_state_nbytes(self) -> int:
        return state_nbytes(self.optimizer)
