"""FSDP2 over one datacenter's ranks: one ``fully_shard`` per transformer block, then the root.

Parameters, gradients and optimizer state are sharded inside the datacenter (dim 0 of every parameter, the
rows :mod:`meridian.workers.distributed.shard_rows` names) and replicated across datacenters, whose sum the
engine adds on top (:mod:`meridian.workers.sync.fsdp_har`). Gradients are summed, never averaged: every rank's
loss is its share of the global-batch mean, so the sum over ranks is the single-process gradient.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# FSDP2's pluggable reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) takes this interface; torch keeps its
# default implementation in a private module.
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

_meshes = itertools.count()


def dc_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """A one-dimensional mesh over the ranks of ``group`` (this rank's datacenter), on ``device``'s type.

    Each mesh gets a dimension name of its own: torch compares meshes by their ranks and names, not by their
    process groups, and DTensor caches what its operations return by mesh, so a re-formed epoch's mesh over the
    same ranks would be served the last epoch's (its destroyed group: "Could not resolve the process group")."""
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=(f"dc{next(_meshes)}",))


def transformer_blocks(model: nn.Module) -> Sequence[nn.Module]:
    """The model's repeated blocks, each its own FSDP unit: a :class:`~meridian.workers.model.causal_lm.CausalLM`'s
    own, a plain module's ``blocks`` ModuleList, or a pipeline stage's ModuleDict of them; none: the model is one
    unit."""
    own = getattr(model, "transformer_blocks", None)
    blocks = own() if callable(own) else getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


class TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, timed: :attr:`seconds` adds up the wall time of every call (on CPU the collective
    itself; on CUDA only the launch, the collective running on FSDP2's stream)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
        t0 = time.perf_counter()
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        self.seconds += time.perf_counter() - t0
        return work

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None, reduce_scatter: TimedReduceScatter | None = None,
    roots: Sequence[nn.Module] | None = None, per_block: bool = True,
) -> list[FSDPModule]:
    """Shard ``model`` in place over ``mesh``: each block, then the root (what is left: embeddings, final norm,
    head). ``roots``: the modules that hold the blocks and the rest, one FSDP root each (a pipeline rank's model
    chunks), instead of ``model`` itself. Returns the FSDP units in backward order's reverse (blocks first, the
    roots last). ``per_block=False``: no unit per block, the root holds the whole model (one gather and one
    reduce-scatter a step)."""
    policy = mp_policy or MixedPrecisionPolicy()
    # Parameters of no elements stay plain tensors on every rank (FSDP2's reduce-scatter takes no empty gradient)
    empty = {p for p in model.parameters() if p.numel() == 0} or None
    units: list[FSDPModule] = []
    for block in transformer_blocks(model) if per_block else ():
        units.append(fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                                 ignored_params=empty))
    # The root's parameters are used first in forward and last in backward: kept unsharded after forward
    # (FSDP2's own default for the root), they are not gathered twice.
    for root in roots or [model]:
        units.append(fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=empty))
    for unit in units:
        # a trainable parameter that took no part in a step's forward gets a zero gradient, so every step's
        # reduce-scatter output has the same layout (the engines' row offsets)
        unit.set_reduce_scatter_unused_params(True, recurse=False)
        unit.set_force_sum_reduction_for_comms(True)  # SUM, not AVG: gloo has no PREMUL_SUM, and we sum
        unit.set_gradient_divide_factor(1.0)
        if reduce_scatter is not None:
            unit.set_custom_reduce_scatter(reduce_scatter)
    return units
