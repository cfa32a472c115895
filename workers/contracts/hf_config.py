"""Hugging Face ``config.json`` ↔ :class:`ModelConfig`, torch-free (the HTTP edge reads a checkpoint's shape).

Supported architectures: ``LlamaForCausalLM`` in and out; ``GPT2LMHeadModel`` out only (Meridian's gpt has
an untied head and exact GELU, real GPT-2 checkpoints tie the head and use the tanh approximation, so they
are refused on the way in rather than loaded subtly wrong). Weights: :mod:`meridian.workers.model.hf`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meridian.workers.contracts.model_config import ModelConfig, ModelFamily


def read_hf_config(directory: str) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.init_from: {directory!r} has no config.json (a local Hugging Face checkpoint "
                         "directory is expected; nothing is ever downloaded)")
    if not any(Path(directory).glob("*.safetensors")):
        raise ValueError(f"model.init_from: {directory!r} has no *.safetensors file")
    return json.loads(path.read_text())


def model_config_from_hf(directory: str, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint in ``directory`` (``init_from`` set to it); ``overrides``
    (e.g. a shorter ``seq_len``) replace the checkpoint's values."""
    hf = read_hf_config(directory)
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
    if arch != "LlamaForCausalLM" and hf.get("model_type") != "llama":
        raise ValueError(f"model.init_from: architecture {arch!r} is not supported (LlamaForCausalLM is)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"model.init_from: RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not "
                         "supported")
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if hf.get(key, ok) != ok:
            raise ValueError(f"model.init_from: config.json has {key}={hf[key]!r}; only {ok!r} is supported")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        raise ValueError(f"model.init_from: head_dim {hf['head_dim']} != hidden_size / num_attention_heads")
    kwargs: dict[str, Any] = dict(
        family=ModelFamily.LLAMA, n_layers=hf["num_hidden_layers"], d_model=d, n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden=hf["intermediate_size"],
        seq_len=min(hf.get("max_position_embeddings", 2048), 32768), vocab_size=hf["vocab_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_from=str(Path(directory).resolve()),
    )
    return ModelConfig(**{**kwargs, **overrides})


def hf_config_of(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` with which ``transformers`` builds the same model as ``cfg``."""
    if cfg.family is ModelFamily.LLAMA:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp_width, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.seq_len, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None,
        }
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads, "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len, "vocab_size": cfg.vocab_size,
        "n_inner": cfg.mlp_width, "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False, "scale_attn_weights": True, "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": None,
    }
