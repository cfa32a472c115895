"""Tensor-parallel plans: which module of a model family is cut how across the ranks of one node (DTensor's
``parallelize_module`` applies them, :mod:`meridian.workers.parallel.parallelize`).

The plans are Megatron's, written as torchtitan writes Llama's and as transformers' ``base_model_tp_plan`` declares
them: the attention's q/k/v and the MLP's input projections column-parallel (output features cut, whole heads per
rank), the attention's and the MLP's output projections row-parallel (input features cut, partial sums reduced),
the token embedding row-parallel over the vocabulary and the head column-parallel over it (its logits gathered, so
the loss is the one-process loss). With ``sequence_parallel`` the norms and the residual stream between them are cut
along the sequence instead of replicated: the row-parallel outputs reduce-scatter and the column-parallel inputs
all-gather, activations between layers are ``tp`` times smaller.

A model whose head shares the embedding's weight keeps both replicated (one parameter cannot take two layouts).
GPT's fused q/k/v weight holds q, k and v one after another: each rank takes its heads of each
(:class:`FusedColwiseParallel`). Plans are keyed by model family in :data:`TP_PLANS`; another family registers
its own with :func:`register_tp_plan`. Module names are relative to a pipeline stage (a stage keeps the whole
model's names: ``blocks.<i>`` of its own blocks, ``tok_emb`` on the first, ``ln_f`` and ``head`` on the last), so
a plan names what exists in any stage and ``parallelize_module`` skips what a stage lacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import _StridedShard

from meridian.workers.contracts.model_config import ModelFamily


class FusedColwiseParallel(ColwiseParallel):
    """Column parallelism of a Linear whose output features are ``parts`` equal parts (GPT's q, k, v): each rank
    holds its chunk of every part, side by side (DTensor's ``_StridedShard``), and the module returns that local
    ``(…, parts × features / tp)`` tensor, whose ``chunk(parts, -1)`` is this rank's heads of each part."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):  # noqa: ANN001 - ParallelStyle's hook
        for pname, param in module.named_parameters():
            placed = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)],
                                       src_data_rank=self.src_data_rank)  # fmt: skip
            module.register_parameter(pname, nn.Parameter(placed, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001
        # the output is strided like the weight: kept as it is, each rank's chunk of every part
        return outputs.to_local() if use_local_output else outputs


class EmbeddingRowwiseParallel(RowwiseParallel):
    """Row parallelism of the token embedding (its vocabulary cut across the ranks), its output reduced before it
    leaves the module: the stock style returns a collective still in flight (an ``AsyncCollectiveTensor``), and a
    compiled block given one as its input passed a wrong gradient back (torch 2.13 on CPU: the embedding's gradient
    lost, the first step's norm 9% low)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


@dataclass(frozen=True)
class TPOptions:
    """What a plan needs to know besides the family."""

    sequence_parallel: bool = False
    tied_embeddings: bool = False
    """The head shares the token embedding's weight: both stay replicated."""


def _ends(opts: TPOptions) -> dict[str, ParallelStyle]:
    """Embeddings, final norm and head. With sequence parallelism the embeddings' output is cut along the sequence
    where it leaves them (GPT's position embedding too, its rows being the positions), not inside the first block:
    a compiled block would not pass the gradient back through its input's conversion."""
    sp = opts.sequence_parallel
    plan: dict[str, ParallelStyle] = {}
    if not opts.tied_embeddings:
        plan["tok_emb"] = EmbeddingRowwiseParallel(input_layouts=Replicate(),
                                                   output_layouts=Shard(1) if sp else Replicate())
        plan["head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    elif sp:
        plan["tok_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                              use_local_output=True)
        plan["head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    if sp:
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0),
                                              use_local_output=True)
        plan["ln_f"] = SequenceParallel()
    return plan


def _block(opts: TPOptions, attention: dict[str, ParallelStyle], mlp_in: tuple[str, ...]) -> dict[str, ParallelStyle]:
    """One block's plan (``blocks.*``): attention and MLP, and the norms before them with sequence parallelism."""
    sp = opts.sequence_parallel
    out = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {f"attn.{k}": v for k, v in attention.items()}
    plan["attn.proj"] = RowwiseParallel(output_layouts=out)
    plan.update({f"mlp.{name}": ColwiseParallel() for name in mlp_in})
    plan["mlp.proj"] = RowwiseParallel(output_layouts=out)
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather, "mlp": gather})
    return {f"blocks.*.{k}": v for k, v in plan.items()}


def gpt_plan(opts: TPOptions) -> dict[str, ParallelStyle]:
    """:class:`~meridian.workers.model.gpt.GPT`: fused q/k/v (each rank its heads of each), GELU MLP ``fc``."""
    return {**_ends(opts), **_block(opts, {"qkv": FusedColwiseParallel(parts=3)}, ("fc",))}


def llama_plan(opts: TPOptions) -> dict[str, ParallelStyle]:
    """:class:`~meridian.workers.model.llama.Llama`: q, k, v (whole query and key/value heads per rank), SwiGLU
    ``gate`` and ``up``."""
    return {**_ends(opts), **_block(opts, {n: ColwiseParallel() for n in ("q", "k", "v")}, ("gate", "up"))}


TP_PLANS: dict[ModelFamily, Callable[[TPOptions], dict[str, ParallelStyle]]] = {
    ModelFamily.GPT: gpt_plan,
    ModelFamily.LLAMA: llama_plan,
}
"""The tensor-parallel plan of each model family."""


def register_tp_plan(family: ModelFamily, plan: Callable[[TPOptions], dict[str, ParallelStyle]]) -> None:
    """Make ``plan`` the tensor-parallel plan of ``family`` (a family without one cannot run with ``tp > 1``)."""
    TP_PLANS[family] = plan


def tp_plan(family: ModelFamily, opts: TPOptions) -> dict[str, ParallelStyle]:
    """The plan of ``family``; a ``ValueError`` naming the field if it has none."""
    if family not in TP_PLANS:
        raise ValueError(f"parallelism.tp > 1: model family {family.value!r} has no tensor-parallel plan")
    return TP_PLANS[family](opts)
