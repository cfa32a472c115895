"""The shape of a Hugging Face causal LM from its ``config.json`` alone, torch-free and transformers-free.

The service admits and plans a job on these numbers (the planner's parameter count, layers, width, context and
vocabulary) without importing torch or transformers; the workers build the real module with transformers
(:mod:`meridian.workers.model.hf_lm`). One table, :data:`FAMILIES`, says for each family Meridian builds which
tensors a decoder layer holds, so the count is exact (``tests/test_hf_models.py`` checks it against the module
transformers builds, for every family here). A ``config.json`` of a family not in the table is refused, naming the
ones that are, rather than planned on a guess.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from meridian.workers.contracts.model_shape import ModelShape


@dataclass(frozen=True, kw_only=True)
class Family:
    """What one transformers family's decoder layer holds, beyond the shape every family shares."""

    architecture: str
    """The ``*ForCausalLM`` class transformers builds for this ``model_type``."""
    qkv_bias: str | bool
    """Biases on the q/k/v projections: always (``True``), never (``False``), or as the config key named says."""
    o_bias: str | bool
    """A bias on the attention's output projection (same convention)."""
    mlp_bias: str | bool = False
    """Biases on the MLP's projections (same convention)."""
    gated_mlp: bool = True
    """SwiGLU-style ``gate``/``up``/``down`` (3 matrices); ``False``: ``up``/``down`` (2)."""
    norm_bias: bool = False
    """LayerNorm (weight and bias) instead of RMSNorm (weight only)."""
    qk_norm: bool = False
    """A per-head RMSNorm on queries and keys (Qwen3)."""
    eps_key: str = "rms_norm_eps"
    theta_key: str = "rope_theta"
    head_dim: int | None = None
    """The config class's ``head_dim`` when config.json gives none (``None``: ``hidden_size / heads``)."""
    declares_tp_plan: bool = True
    """transformers declares a tensor-parallel plan (``base_model_tp_plan``) on the family's config class."""


FAMILIES: dict[str, Family] = {
    "llama": Family(architecture="LlamaForCausalLM", qkv_bias="attention_bias", o_bias="attention_bias",
                    mlp_bias="mlp_bias"),
    "mistral": Family(architecture="MistralForCausalLM", qkv_bias=False, o_bias=False),
    "qwen2": Family(architecture="Qwen2ForCausalLM", qkv_bias=True, o_bias=False),
    "qwen3": Family(architecture="Qwen3ForCausalLM", qkv_bias="attention_bias", o_bias="attention_bias",
                    qk_norm=True, head_dim=128),
    "gpt_neox": Family(architecture="GPTNeoXForCausalLM", qkv_bias="attention_bias", o_bias="attention_bias",
                       mlp_bias=True, gated_mlp=False, norm_bias=True, eps_key="layer_norm_eps",
                       theta_key="rotary_emb_base"),
}
"""The Hugging Face families Meridian builds, by ``model_type``."""

_DEFAULT_TRUE = {"gpt_neox": {"attention_bias"}}
"""Flags whose transformers default is true for a family (absent from config.json means on)."""


def supported_families() -> str:
    """The families of :data:`FAMILIES` as a person reads them: ``LlamaForCausalLM (llama), ...``."""
    return ", ".join(f"{f.architecture} ({t})" for t, f in FAMILIES.items())


@dataclass(frozen=True, kw_only=True)
class HFShape:
    """The numbers admission and the planner read of one Hugging Face model."""

    model_type: str
    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    tie_embeddings: bool
    num_params: int
    """Every parameter of the module transformers builds from the config (a tied head counted once)."""

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model


def shape_of(config: dict[str, Any]) -> HFShape:
    """The shape of the model ``config`` (a ``config.json`` object already checked by
    :mod:`meridian.workers.contracts.hf_config`: every size present and whole) describes."""
    model_type = config["model_type"]
    fam = FAMILIES[model_type]
    d, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or fam.head_dim or d // heads
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    tie = bool(config.get("tie_word_embeddings", False))

    # the count is the planner's shape's: one formula for every family (tests/test_hf_models.py checks it against
    # the modules transformers builds)
    total = ModelShape.from_hf_config(config).num_params
    return HFShape(model_type=model_type, architecture=fam.architecture, n_layers=layers, d_model=d, n_heads=heads,
                   n_kv_heads=kv, head_dim=hd, ffn_hidden=ffn, vocab_size=vocab, tie_embeddings=tie,
                   num_params=total)


@functools.lru_cache(maxsize=256)
def shape_of_json(hf_config: str) -> HFShape:
    """:func:`shape_of` of a :class:`~meridian.workers.contracts.model_config.ModelConfig`'s ``hf_config`` (the
    planner asks for the count many times per plan: parsed once)."""
    return shape_of(json.loads(hf_config))


__all__ = ["FAMILIES", "Family", "HFShape", "shape_of", "shape_of_json", "supported_families"]
