"""Tensor-parallel plans: which module of a model is cut how across the ranks of one node, as torch's DTensor
styles for ``parallelize_module`` (applied by :mod:`meridian.workers.parallel.parallelize`). :func:`tp_styles` is
the one place a job's plan comes from.

- **Meridian's families** (GPT, Llama) have plans written here, as torchtitan writes Llama's: Megatron's split, the
  attention's q/k/v and the MLP's input projections column-parallel (output features cut, whole heads per rank),
  the attention's and the MLP's output projections row-parallel (input features cut, partial sums reduced), the
  token embedding row-parallel over the vocabulary and the head column-parallel over it (its logits gathered, so the
  loss is the one-process loss). With ``sequence_parallel`` the norms and the residual stream between them are cut
  along the sequence instead of replicated: the row-parallel outputs reduce-scatter and the column-parallel inputs
  all-gather, activations between layers are ``tp`` times smaller. A model whose head shares the embedding's
  weight keeps both replicated (one parameter cannot take two layouts). GPT's fused q/k/v weight holds q, k and v
  one after another: each rank takes its heads of each (:class:`FusedColwiseParallel`). Module names are relative
  to a pipeline stage (a stage keeps the whole model's names: ``blocks.<i>`` of its own blocks, ``tok_emb`` on the
  first, ``ln_f`` and ``head`` on the last), so a plan names what exists in any stage and ``parallelize_module``
  skips what a stage lacks.
- **Other models** declare theirs (:attr:`~meridian.workers.model.causal_lm.CausalLM.tp_plan`) in transformers'
  format: a module-name pattern (``*`` stands for one name, a block's index) → a style name. Hugging Face models
  carry the plan transformers declares for their family (``base_model_tp_plan``, with the head's), a factory's
  module its ``tp_plan`` attribute. :func:`check_tp_plan` refuses a plan with a style it does not know, a pattern
  that matches no module, a module of the wrong kind, or a width (heads included) that ``tp`` does not divide,
  each named; :func:`parallel_styles` turns it into DTensor styles.
"""

from __future__ import annotations

import re
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
from meridian.workers.model.causal_lm import CausalLM


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
"""The tensor-parallel plan of each of Meridian's model families."""



# -- plans a model declares (transformers' format) ---------------------------------------------------------
COLUMN = ("colwise", "colwise_gather_output", "colwise_rep")
ROW = ("rowwise", "rowwise_rep")
EMBEDDING = ("embedding_rowwise",)
REPLICATED = ("replicated_with_grad_allreduce",)
"""Parameters that stay whole on every tensor-parallel rank; their gradients are summed over the group."""
STYLES = (*COLUMN, *ROW, *EMBEDDING, *REPLICATED)


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in key.split("*")) + "$")


def heads_of(model: CausalLM) -> tuple[int, int] | None:
    """(query heads, key/value heads) of ``model``, where it says (``None``: a factory's module)."""
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "kv_heads", None) or heads
    return (heads, kv) if heads else None


def check_tp_plan(model: CausalLM, tp: int) -> dict[str, str]:
    """``model``'s plan, checked for ``tp`` ranks; ``ValueError`` naming the reason otherwise (a model without one
    says so: tensor parallelism needs a plan)."""
    name = getattr(model, "architecture", type(model).__name__)
    plan = model.tp_plan
    if plan is None:
        raise ValueError(f"parallelism.tp={tp}: {name} declares no tensor-parallel plan (transformers' "
                         "base_model_tp_plan, or a factory module's tp_plan), so it cannot be split across ranks")
    modules = dict(model.named_modules())
    problems = []
    heads = heads_of(model)
    if heads and (heads[0] % tp or heads[1] % tp):
        problems.append(f"tp={tp} does not divide its {heads[0]} attention heads and {heads[1]} key/value heads")
    for key, style in plan.items():
        if style not in STYLES:
            problems.append(f"{key!r}: style {style!r} is none of {', '.join(STYLES)}")
            continue
        hits = [(n, m) for n, m in modules.items() if _pattern(key).match(n)]
        if not hits:
            problems.append(f"{key!r} matches no module")
        for n, m in hits:
            if style in REPLICATED:
                continue
            kind = nn.Embedding if style in EMBEDDING else nn.Linear
            if not isinstance(m, kind):
                problems.append(f"{n} is a {type(m).__name__}, not the {kind.__name__} style {style!r} splits")
                continue
            width = (m.num_embeddings if style in EMBEDDING else m.out_features if style in COLUMN
                     else m.in_features)
            if width % tp:
                problems.append(f"tp={tp} does not divide {n}'s {width} {'rows' if style in EMBEDDING else 'features'}")
    if problems:
        raise ValueError(f"parallelism.tp={tp}: {name}'s tensor-parallel plan cannot split it: " + "; ".join(problems))
    return dict(plan)


def untied(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` without the entries of modules whose weight another module shares (a tied head and embedding):
    those stay whole on every tensor-parallel rank, as Meridian's own plans keep them. Splitting one of the two
    would give it a weight of its own and untie them."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            owners.setdefault(id(weight), []).append(name)
    shared = {n for names in owners.values() if len(names) > 1 for n in names}
    return {k: v for k, v in plan.items() if not any(_pattern(k).match(n) for n in shared)}


def parallel_styles(plan: dict[str, str]) -> tuple[dict[str, ParallelStyle], list[str]]:
    """torch's DTensor styles of ``plan`` for ``parallelize_module`` (Megatron's split: column-wise layers keep their
    outputs sharded, row-wise ones all-reduce theirs), and the patterns left replicated (whose gradients the caller
    sums over the tensor-parallel group)."""
    styles: dict[str, ParallelStyle] = {}
    replicated = []
    for key, style in plan.items():
        if style == "colwise":
            styles[key] = ColwiseParallel()
        elif style in ("colwise_gather_output", "colwise_rep"):
            styles[key] = ColwiseParallel(output_layouts=Replicate())
        elif style == "rowwise":
            styles[key] = RowwiseParallel()
        elif style in ("rowwise_rep", "embedding_rowwise"):
            styles[key] = RowwiseParallel(input_layouts=Replicate())
        elif style in REPLICATED:
            replicated.append(key)
        else:
            raise ValueError(f"tensor-parallel style {style!r} of {key!r} is none of {', '.join(STYLES)}")
    return styles, replicated



def tp_styles(model: nn.Module, family: ModelFamily, tp: int, *, sequence_parallel: bool = False,
              tied_embeddings: bool = False) -> dict[str, ParallelStyle]:
    """``model``'s tensor-parallel plan over ``tp`` ranks as DTensor styles: its family's plan (Meridian's
    families), or the plan it declares, checked against it, a tied head and embedding left whole. A
    ``ValueError`` naming the field where it cannot be split."""
    if family in TP_PLANS:
        return TP_PLANS[family](TPOptions(sequence_parallel=sequence_parallel, tied_embeddings=tied_embeddings))
    assert isinstance(model, CausalLM), type(model)
    styles, replicated = parallel_styles(untied(model, check_tp_plan(model, tp)))
    if replicated:
        raise ValueError(f"parallelism.tp={tp}: the model's tensor-parallel plan leaves {replicated} replicated "
                         "with summed gradients, which this runtime does not run; set parallelism.tp to 1")
    return styles
