"""A model's tensor-parallel plan (:attr:`CausalLM.tp_plan`): checked against the module it describes, and given
as torch's DTensor styles for ``torch.distributed.tensor.parallel.parallelize_module``.

A plan is transformers' format: a module-name pattern (``*`` stands for one name, a block's index) → a style.
Hugging Face models carry the plan transformers declares for their family (``base_model_tp_plan``, with the
head's), Meridian's llama its own, a factory's module its ``tp_plan`` attribute. :func:`check_tp_plan` refuses a
plan with a style it does not know, a pattern that matches no module, a module of the wrong kind, or a width
(heads included) that ``tp`` does not divide, each named.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from meridian.workers.model.causal_lm import CausalLM

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


def parallel_styles(plan: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """torch's DTensor styles of ``plan`` for ``parallelize_module`` (Megatron's split: column-wise layers keep their
    outputs sharded, row-wise ones all-reduce theirs), and the patterns left replicated (whose gradients the caller
    sums over the tensor-parallel group)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {}
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


__all__ = ["STYLES", "check_tp_plan", "heads_of", "parallel_styles", "untied"]
