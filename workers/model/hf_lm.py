"""A Hugging Face causal LM as a :class:`~meridian.workers.model.causal_lm.CausalLM`: transformers builds the
module from the job's ``config.json`` (:attr:`ModelConfig.hf_config`), Meridian loads the weights.

:class:`HFCausalLM` takes over the children of the ``*ForCausalLM`` transformers built (its base model and its
head), so parameter names are transformers' own (``model.layers.0.self_attn.q_proj.weight``): checkpoints, the
tensor-parallel plan transformers declares (``_tp_plan``) and export all use them unchanged. The forward runs the
base model to its final hidden states and applies the head itself, which is what lets the loss be computed in
chunks (:func:`~meridian.workers.model.causal_lm.chunked_loss`); every family of
:data:`~meridian.workers.contracts.hf_shape.FAMILIES` applies nothing after its head, and a test checks the logits
against transformers' own forward for each. With ``init_from`` the module is built with its parameters on the
meta device and filled from the safetensors shards (:mod:`meridian.workers.model.weights`); checkpoint names
pass through transformers' declared renames (``get_model_conversion_mapping``: GPT-NeoX stores ``embed_out``
for the head it calls ``lm_head``), the same renames reversed on the way out.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.model.causal_lm import CausalLM, find_blocks
from meridian.workers.model.weights import LoadReport, load_checkpoint, parameters_on_meta


class HFCausalLM(CausalLM):
    """The children of a transformers ``*ForCausalLM``, with Meridian's forward."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        if hf._parameters or hf._buffers:
            raise ValueError(f"{type(hf).__name__} holds parameters of its own, outside its base model and head")
        head = hf.get_output_embeddings()
        for name, child in hf.named_children():
            self.add_module(name, child)
        self.architecture = type(hf).__name__
        self.config = hf.config
        self.vocab_size = hf.config.vocab_size
        self._base_name = hf.base_model_prefix
        self._head_name = next(n for n, c in hf.named_children() if c is head)
        # The list itself, kept unregistered (it is already a child of the base model): wrapping its items later
        # (activation checkpointing, compile) leaves it the list of blocks.
        object.__setattr__(self, "_blocks", find_blocks(getattr(self, self._base_name),
                                                        frozenset(getattr(hf, "_no_split_modules", None) or ())))
        plan = getattr(hf, "_tp_plan", None) or {}
        self._tp_plan = dict(plan) if getattr(hf.config, "base_model_tp_plan", None) else None
        self._renames = _renames(hf)
        self._ignore = tuple(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or ())

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._base_name)(input_ids=idx, use_cache=False).last_hidden_state

    def output_head(self) -> nn.Module:
        return getattr(self, self._head_name)

    def transformer_blocks(self) -> nn.ModuleList:
        return self._blocks

    @property
    def tp_plan(self) -> dict[str, str] | None:
        return None if self._tp_plan is None else dict(self._tp_plan)

    def export_name(self, name: str) -> str:
        for transform in self._renames[1]:
            name, _ = transform.rename_source_key(name)
        return name

    def checkpoint_name(self, key: str) -> str:
        """The parameter a checkpoint's tensor ``key`` loads into (transformers' renames, in order)."""
        for transform in self._renames[0]:
            key, _ = transform.rename_source_key(key)
        return key


def _renames(hf: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' declared checkpoint renames of ``hf``'s family (in: with the legacy ones, out: the family's
    own reversed), refusing a family whose checkpoints need more than renames (merged experts)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    load, save = get_model_conversion_mapping(hf, add_legacy=True), get_model_conversion_mapping(hf, add_legacy=False)
    other = [type(t).__name__ for t in load if not isinstance(t, WeightRenaming)]
    if other:
        raise ValueError(f"{type(hf).__name__}'s checkpoints need transformers' conversions {other}, beyond renames: "
                         "Meridian loads renamed tensors only")
    return load, [t.reverse_transform() for t in save]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("a Hugging Face model (model.init_from, model.config) is built by transformers, which is "
                          "not installed here: pip install 'meridian-train[hf]' on every worker node and where export "
                          "runs") from None
    return transformers


def hf_config_object(cfg: ModelConfig) -> Any:
    """transformers' config object of ``cfg.hf_config``."""
    AutoConfig = _transformers().AutoConfig  # noqa: N806

    body = json.loads(cfg.hf_config)
    return AutoConfig.for_model(body.pop("model_type"), **body)


def build_hf(cfg: ModelConfig, *, meta: bool = False) -> HFCausalLM:
    """The module of ``cfg`` (family ``hf``) in fp32: from ``init_from``'s weights (built on the meta device,
    then filled shard by shard), or with transformers' own initialisation from the current torch seed; with
    ``meta``, left on the meta device (shapes only)."""
    AutoModelForCausalLM = _transformers().AutoModelForCausalLM  # noqa: N806

    config = hf_config_object(cfg)
    if meta or cfg.init_from:
        with parameters_on_meta():
            lm = HFCausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        if not meta:
            load_hf_weights(lm, cfg.init_from)
        return lm
    return HFCausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def load_hf_weights(lm: HFCausalLM, directory: str, **kwargs: Any) -> LoadReport:
    """Fill ``lm`` from the safetensors checkpoint in ``directory`` (:func:`load_checkpoint`)."""
    ignore = (*lm._ignore, r"rotary_emb\.inv_freq$")  # as transformers' own loader skips them
    return load_checkpoint(lm, directory, rename=lm.checkpoint_name, ignore=ignore,
                           describe=f"the {lm.architecture} its config.json describes", **kwargs)


__all__ = ["HFCausalLM", "build_hf", "hf_config_object", "load_hf_weights"]
