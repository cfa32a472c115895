"""Gradient-sync engines: how the data-parallel replicas agree on one update per step.

- ``flat``: :class:`FlatSync`, PyTorch DDP over all ranks (:mod:`meridian.workers.sync.flat`).
- ``hierarchical``: :class:`FSDPHierarchicalSync` (:mod:`meridian.workers.sync.fsdp_har`): FSDP2 inside each DC
  (parameters, gradients and AdamW state sharded there, replicated across DCs), each rank's gradient rows summed
  across DCs, overlapped with backward (``overlap``), optionally compressed (``compression``), one step late
  (``delay_one_step``) and at a local look-ahead (``local_lookahead``).
- ``diloco`` / ``streaming-diloco``: :class:`DiLoCoSync` (:mod:`meridian.workers.sync.diloco`): FSDP2 inside each
  DC every step, and an outer Nesterov step on parameter deltas across DCs every H steps (per fragment).

Tensor- and pipeline-parallel replicas build :class:`FSDPHierarchicalSync` themselves
(:mod:`meridian.workers.loop.parallel`). The interface and call order are in :mod:`meridian.workers.sync.engine`.
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
    reshard_after_forward: bool = True,
) -> GradientSync:
    """The engine ``sync`` asks for. Build it after the model is on its device: it takes the device from there.

    ``emulator`` (:mod:`meridian.workers.wan.collectives`) delays every inter-DC collective to the emulated link's pace.
    ``broadcast_params=False``: the caller sets every rank's weights itself (a re-formed epoch's restore), so the
    engines on FSDP2 skip their broadcast of rank 0's (flat sync relies on the seeded build alone).
    ``shard``: applies FSDP2 (and what comes before it) for the engines on FSDP2
    (:class:`~meridian.workers.parallel.parallelize.Parallelize`); flat sync ignores it. ``reshard_after_forward``:
    the one ``shard`` applies (``False``: the engine keeps the units gathered across a step's micro-batches)."""
    if sync.strategy is SyncStrategy.FLAT:
        return FlatSync(model, groups, sync, optim, emulator=emulator)
    if sync.strategy.is_diloco:
        return DiLoCoSync(model, groups, sync, optim, emulator=emulator, broadcast_params=broadcast_params, shard=shard,
                          reshard_after_forward=reshard_after_forward)
    if groups.mp_norm is not None:
        raise ValueError("build_sync builds the engine of a data-parallel replica; a tensor/pipeline-parallel one "
                         "builds FSDPHierarchicalSync over its data-parallel group (meridian.workers.loop.parallel)")
    return FSDPHierarchicalSync(model, groups, sync, optim, emulator=emulator, broadcast_params=broadcast_params,
                                shard=shard, reshard_after_forward=reshard_after_forward)


def runs_on_fsdp(sync: SyncConfig) -> bool:
    """Whether ``sync`` trains on FSDP2: every strategy but ``flat`` (DDP) does."""
    return sync.strategy is not SyncStrategy.FLAT
