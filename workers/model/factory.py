"""A user's own ``nn.Module`` as a :class:`~meridian.workers.model.causal_lm.CausalLM`: built by a factory the
operator installed and allowed (:mod:`meridian.service.model_access` decides which; this module only imports what
the admitted config names).

The factory is a function of plain JSON keyword arguments returning an ``nn.Module`` whose ``forward(idx)`` maps
(batch, time) token ids to (batch, time, vocab) logits (a tensor, or an object with ``.logits``). Its repeated
blocks are one ``nn.ModuleList`` of one class: the class the job names (``model.block``), else one named in the
module's ``_no_split_modules``, else the list holding the most parameters. A module that also defines
``hidden_states(idx)`` and ``output_head()`` gets the chunked loss and the hidden-state forward; a
``tp_plan`` attribute (module-name pattern → style) is its tensor-parallel plan.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import torch
from torch import nn

from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.model.causal_lm import CausalLM, find_blocks, per_sample_loss


class FactoryCausalLM(CausalLM):
    """The children of a factory's module (same names), its own forward run on them."""

    def __init__(self, inner: nn.Module, *, block: str = "", vocab_size: int) -> None:
        super().__init__()
        if inner._parameters or inner._buffers:
            raise ValueError(f"{type(inner).__name__} holds parameters or buffers directly "
                             f"({', '.join([*inner._parameters, *inner._buffers])}): keep them in submodules")
        for name, child in inner.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "_inner", inner)  # not a child: its children are this module's
        self.vocab_size = vocab_size
        names = {block} if block else set(getattr(inner, "_no_split_modules", None) or ())
        # The list itself, kept unregistered (it is already a child under its own name): wrapping its items later
        # (activation checkpointing, compile) leaves it the list of blocks.
        object.__setattr__(self, "_blocks", find_blocks(self, names))
        self._split = callable(getattr(inner, "hidden_states", None)) and callable(getattr(inner, "output_head", None))

    def train(self, mode: bool = True) -> FactoryCausalLM:
        super().train(mode)
        self._inner.training = mode  # its own forward may read it
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                hidden: bool = False) -> torch.Tensor:
        if self._split:
            return super().forward(idx, targets, hidden=hidden)
        if hidden:
            raise ValueError(f"{type(self._inner).__name__} has no hidden_states(idx) and output_head(): only its "
                             "logits can be asked for")
        out = self._inner(idx)
        logits = getattr(out, "logits", out)
        return logits if targets is None else per_sample_loss(logits, targets)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        return self._inner.hidden_states(idx)

    def output_head(self) -> nn.Module:
        return self._inner.output_head()

    def transformer_blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def tp_plan(self) -> dict[str, str] | None:
        plan = getattr(self._inner, "tp_plan", None)
        return dict(plan) if plan else None


def factory_function(path: str) -> Any:
    """The callable ``module:attr`` names (``attr`` may be dotted); imports ``module``."""
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def build_factory(cfg: ModelConfig) -> FactoryCausalLM:
    """The module of ``cfg`` (family ``factory``), initialised by the factory from the current torch seed."""
    inner = factory_function(cfg.factory)(**json.loads(cfg.factory_args or "{}"))
    if not isinstance(inner, nn.Module):
        raise TypeError(f"model.factory {cfg.factory} returned a {type(inner).__name__}, not an nn.Module")
    return FactoryCausalLM(inner, block=cfg.block, vocab_size=cfg.vocab_size)


__all__ = ["FactoryCausalLM", "build_factory", "factory_function"]
