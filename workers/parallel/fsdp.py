"""FSDP2 over one datacenter's ranks: one ``fully_shard`` per transformer block, then the root.

Parameters, gradients and optimizer state are sharded inside the datacenter (dim 0 of every parameter, the
rows :mod:`meridian.workers.distributed.shard_rows` names) and replicated across datacenters, whose sum the
engine adds on top (:mod:`meridian.workers.sync.fsdp_har`). Gradients are summed, never averaged: every rank's
loss is its share of the global-batch mean, so the sum over ranks is the single-process gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def dc_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh over the ranks of ``group`` (this rank's datacenter), on ``device``'s type."""
    return DeviceMesh.from_group(group, device.type)


def transformer_blocks(model: nn.Module) -> Sequence[nn.Module]:
    """The model's repeated blocks (its ``blocks`` ModuleList, or a pipeline stage's ModuleDict of them), each its
    own FSDP unit; none: the model is one unit."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None, roots: Sequence[nn.Module] | None = None,
) -> list[FSDPModule]:
    """Shard ``model`` in place over ``mesh``: each block, then the root (what is left: embeddings, final norm,
    head). ``roots``: the modules that hold the blocks and the rest, one FSDP root each (a pipeline rank's model
    chunks), instead of ``model`` itself. Returns the FSDP units in backward order's reverse (blocks first, the
    roots last)."""
    policy = mp_policy or MixedPrecisionPolicy()
    units: list[FSDPModule] = []
    for block in transformer_blocks(model):
        units.append(fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy))
    # The root's parameters are used first in forward and last in backward: kept unsharded after forward
    # (FSDP2's own default for the root), they are not gathered twice.
    for root in roots or [model]:
        units.append(fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=policy))
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)  # SUM, not AVG: gloo has no PREMUL_SUM, and we sum
        unit.set_gradient_divide_factor(1.0)
    return units
