"""Activation checkpointing per transformer block: ``none``, ``selective`` or ``full``
(``training.activation_checkpointing``).

``full`` keeps only each block's input and runs the block's forward again inside its backward; ``selective`` keeps
the outputs of the matmuls, of attention and of the tensor-parallel collectives and recomputes only the cheap
element-wise ops between them (norms, activations, residual adds: most of a block's activation memory, little of
its compute), torchtitan's op-level policy without its every-other-matmul rule. Both use non-reentrant
``torch.utils.checkpoint`` and leave the block in place: its forward is wrapped, its parameters keep their names
(``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module.`` into every one), so optimizer state, snapshots
and checkpoints read the same names with it on or off. Applied after tensor parallelism and before
``torch.compile`` and FSDP2 (:func:`meridian.workers.parallel.parallelize.parallelize`).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from meridian.workers.contracts.config import ActivationCheckpointing


def _saved_ops() -> set[Any]:
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default,
           aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default, c10d.all_reduce.default}  # fmt: skip
    cudnn = getattr(aten, "_scaled_dot_product_cudnn_attention", None)
    if cudnn is not None:
        ops.add(cudnn.default)
    return ops


_SAVED = _saved_ops()


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def _context(mode: ActivationCheckpointing):
    if mode is ActivationCheckpointing.SELECTIVE:
        return partial(create_selective_checkpoint_contexts, _keep_matmuls)
    return noop_context_fn


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: ActivationCheckpointing) -> None:
    """Wrap each block's forward in place (``none``: leave them as they are)."""
    if mode is ActivationCheckpointing.NONE:
        return
    context_fn = _context(mode)
    for block in blocks:
        forward = block.forward

        def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        block.forward = checkpointed  # an instance attribute: nn.Module's __call__ runs it, hooks included
