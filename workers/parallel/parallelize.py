"""The one function that applies a job's parallelisms to this rank's part of the model, in torchtitan's order
(``parallelize_llama``)::

    1) tensor parallelism      DTensor's parallelize_module with the family's plan   (:mod:`.tp_plan`)
    2) activation checkpointing per block: none | selective | full                  (:mod:`.checkpointing`)
    3) torch.compile           per block, in place (parameter names unchanged)
    4) FSDP2                   per block, then each model chunk's root, over this datacenter's data-parallel
                               ranks (with TP: the ``dp`` dimension of a (dp, tp) mesh), mixed precision as
                               FSDP2's policy                                         (:mod:`.fsdp`)

The sync engine calls it (:class:`~meridian.workers.sync.fsdp_har.FSDPHierarchicalSync`'s ``shard``), after it
broadcast the weights, and adds the inter-datacenter sum on top. Nothing here talks across datacenters.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from meridian.workers.contracts.config import ActivationCheckpointing, FsdpUnits
from meridian.workers.parallel.checkpointing import apply_activation_checkpointing
from meridian.workers.parallel.fsdp import TimedReduceScatter, apply_fsdp, transformer_blocks


@dataclass(frozen=True)
class Parallelize:
    """How one rank's model is parallelised (see the module docstring for the order)."""

    dp_mesh: DeviceMesh
    """This datacenter's data-parallel ranks of this rank's (stage, TP rank): FSDP2 shards over them."""
    tp_mesh: DeviceMesh | None = None
    tp_plan: dict[str, ParallelStyle] = field(default_factory=dict)
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    compile: bool = False
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    fsdp_units: FsdpUnits = FsdpUnits.BLOCK
    """One FSDP2 unit per block, or the whole model as one (:class:`~meridian.workers.contracts.config.FsdpUnits`)."""
    reshard_after_forward: bool = True
    """FSDP2 frees each block's gathered parameters after its forward (gathering them again for backward); off
    they stay gathered until the engine reshards them (:attr:`~meridian.workers.contracts.config.ParallelConfig.
    reshard_after_forward`), and a pipeline's micro-batches do not gather them once per micro-batch."""

    def __call__(self, model: nn.Module, roots: Sequence[nn.Module] | None = None,
                 reduce_scatter: TimedReduceScatter | None = None) -> list[FSDPModule]:
        """Apply 1) to 4) to ``model`` in place; ``roots``: the model chunks of a pipeline rank (``None``: the model
        is one); ``reduce_scatter``: FSDP2's, timed. Returns the FSDP units, blocks first, the roots last."""
        if self.tp_mesh is not None and self.tp_plan:  # 1)
            parallelize_module(model, self.tp_mesh, present(model, self.tp_plan))
        prepare_blocks(model, self.activation_checkpointing, self.compile)  # 2) and 3)
        return apply_fsdp(model, self.dp_mesh, reshard_after_forward=self.reshard_after_forward,  # 4)
                          mp_policy=self.mp_policy, roots=roots, reduce_scatter=reduce_scatter,
                          per_block=self.fsdp_units is FsdpUnits.BLOCK)


def prepare_blocks(model: nn.Module, activation_checkpointing: ActivationCheckpointing, compile: bool) -> None:
    """2) activation checkpointing and 3) ``torch.compile`` of every block, in place (also for the engines that do
    not run on FSDP2: data parallelism under DDP, DiLoCo)."""
    blocks = transformer_blocks(model)
    apply_activation_checkpointing(blocks, activation_checkpointing)
    if compile:
        for block in blocks:
            block.compile()


def present(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries of ``plan`` that name a module of ``model`` (a pipeline stage lacks the others' modules)."""
    names = [n for n, _ in model.named_modules() if n]
    return {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
