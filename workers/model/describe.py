"""``python -m meridian.workers.model.describe``: what admission needs to know of a factory's module, measured on
the module itself, in a process of its own (the service never imports torch or a user's code).

Reads one JSON object on stdin, ``{"factory": "module:function", "args": {...}, "block": "", "seq_len": N}``,
builds the module on the meta device (no memory, no initialisation) and prints one JSON object: its repeated
block class and how many there are, its parameters (a tied tensor once), its token embedding's rows and width,
whether the head shares that embedding, whether it declares a tensor-parallel plan, and whether a forward of
``(1, min(8, seq_len))`` token ids gave ``(1, t, vocab)`` logits (``forward_checked``: false where a meta kernel is
missing, so it could not be run). On a failure it prints ``{"error": "..."}`` and exits 1.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch
from torch import nn

from meridian.workers.model.factory import FactoryCausalLM, factory_function


def describe(request: dict[str, Any]) -> dict[str, Any]:
    """The description of the factory's module (see the module's docstring)."""
    with torch.device("meta"):
        inner = factory_function(request["factory"])(**request.get("args", {}))
        if not isinstance(inner, nn.Module):
            raise TypeError(f"it returned a {type(inner).__name__}, not an nn.Module")
        lm = FactoryCausalLM(inner, block=request.get("block", ""), vocab_size=0)
        embedding = next((m for m in lm.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is None:
            raise ValueError("its module has no nn.Embedding of the token ids (its first one is read as the "
                             "vocabulary and width)")
        lm.vocab_size = embedding.num_embeddings
        tied = any(isinstance(m, nn.Linear) and m.weight is embedding.weight for m in lm.modules())
        blocks = lm.transformer_blocks()
        t = min(8, int(request.get("seq_len", 8)))
        checked = True
        try:
            logits = lm(torch.zeros(1, t, dtype=torch.long))
        except NotImplementedError:
            checked = False
        else:
            if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (1, t, embedding.num_embeddings):
                got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                raise ValueError(f"its forward of (1, {t}) token ids gave {got}, not (1, {t}, "
                                 f"{embedding.num_embeddings}) logits")
    return {"block": type(blocks[0]).__name__, "n_layers": len(blocks),
            "param_count": sum(p.numel() for p in lm.parameters()), "vocab_size": embedding.num_embeddings,
            "d_model": embedding.embedding_dim, "tie_embeddings": tied, "tp_plan": lm.tp_plan is not None,
            "forward_checked": checked}


def main() -> int:
    try:
        print(json.dumps(describe(json.loads(sys.stdin.read()))))
        return 0
    except Exception as e:  # noqa: BLE001 - any failure of the user's code is reported, as JSON
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(json.dumps({"error": f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno})"}))
        return 1


if __name__ == "__main__":
    sys.exit(main())
