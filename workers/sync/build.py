"""Gradient-sync engines: how the data-parallel replicas agree on one update per step.

- ``flat``: :class:`FlatSync`, PyTorch DDP over all ranks (:mod:`meridian.workers.sync.flat`).
- ``hierarchical``: :class:`HierarchicalSync` (:mod:`meridian.workers.sync.hierarchical`): bucketed
  hierarchical all-reduce, overlapped with backward (``overlap``), with a replicated or DC-sharded AdamW
  (``shard_optimizer``) and an optionally compressed inter-DC step (``compression``).
- ``diloco`` / ``streaming-diloco``: :class:`DiLoCoSync` (:mod:`meridian.workers.sync.diloco`): FSDP2 inside each
  DC every step, and an outer Nesterov step on parameter deltas across DCs every H steps (per fragment).

The interface and call order are in :mod:`meridian.workers.sync.engine`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule

from meridian.workers.contracts.config import OptimConfig, SyncConfig, SyncStrategy
from meridian.workers.distributed.layout import DCGroups
from meridian.workers.sync.diloco import DiLoCoSync
from meridian.workers.sync.engine import GradientSync
from meridian.workers.sync.flat import FlatSync
from meridian.workers.sync.fsdp_har import FSDPHierarchicalSync
from meridian.workers.sync.hierarchical import HierarchicalSync
from meridian.workers.wan.emulator import WanEmulator


def build_sync(
    model: nn.Module,
    groups: DCGroups,
    sync: SyncConfig,
    optim: OptimConfig,
    *,
    emulator: WanEmulator | None = None,
    broadcast_params: bool = True,
    shard: Callable[[nn.Module], list[FSDPModule]] | None = None,
) -> GradientSync:
    """The engine ``sync`` asks for. Build it after the model is on its device: it takes the device from there.

    ``emulator`` (:mod:`meridian.workers.wan.collectives`) delays every inter-DC collective to the emulated link's pace.
    ``broadcast_params=False``: the caller sets every rank's weights itself (a re-formed epoch's restore), so the
    hierarchical engine skips its broadcast of rank 0's (the other engines rely on the seeded build alone).
    ``shard``: applies FSDP2 (and what comes before it) for the engine on FSDP2
    (:class:`~meridian.workers.parallel.parallelize.Parallelize`); the others ignore it."""
    if sync.strategy is SyncStrategy.FLAT:
        return FlatSync(model, groups, sync, optim, emulator=emulator)
    if sync.strategy.is_diloco:
        return DiLoCoSync(model, groups, sync, optim, emulator=emulator, broadcast_params=broadcast_params, shard=shard)
    if runs_on_fsdp(sync, groups):
        return FSDPHierarchicalSync(model, groups, sync, optim, emulator=emulator, broadcast_params=broadcast_params,
                                    shard=shard)
    return HierarchicalSync(model, groups, sync, optim, emulator=emulator, broadcast_params=broadcast_params)


def runs_on_fsdp(sync: SyncConfig, groups: DCGroups | None = None) -> bool:
    """Whether ``sync`` trains on FSDP2 (:class:`FSDPHierarchicalSync`, or :class:`DiLoCoSync` on it): hierarchical
    sync of a data-parallel replica (exact, one step late, the look-ahead) and DiLoCo. A replicated optimizer still
    runs on the flat-bucket engine, as do tensor/pipeline-parallel replicas (``groups.mp_norm``)."""
    if groups is not None and groups.mp_norm is not None:
        return False
    return sync.strategy.is_diloco or (sync.strategy is SyncStrategy.HIERARCHICAL and sync.shard_optimizer)

