"""Hugging Face ``config.json`` ↔ :class:`ModelConfig`, torch-free (the HTTP edge reads a checkpoint's shape).

Supported architectures: ``LlamaForCausalLM`` in and out; ``GPT2LMHeadModel`` out only (Meridian's gpt has
an untied head and exact GELU, real GPT-2 checkpoints tie the head and use the tanh approximation, so they
are refused on the way in rather than loaded subtly wrong). Weights: :mod:`meridian.workers.model.hf`.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from meridian.workers.contracts.fields import bounds_of
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily
from meridian.workers.data.source import NotRegularFile, open_regular

CONFIG_MAX_BYTES = 1 << 20
"""A Hugging Face ``config.json`` is a few KB; a bigger one is not read (it is not one, and reading it costs)."""

_FIX = "give init_from the directory transformers' save_pretrained wrote, with its own config.json"


def read_hf_config(directory: str) -> dict[str, Any]:
    """The JSON object of ``directory``'s ``config.json``, opened as :func:`open_regular` does (a named pipe
    cannot hang the service, a symlink or device is refused); ``ValueError`` naming the file otherwise."""
    path = os.path.join(directory, "config.json")
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise ValueError(f"model.init_from: {directory!r} has no config.json (a local Hugging Face checkpoint "
                         "directory is expected; nothing is ever downloaded)") from None
    except OSError as e:
        why = ("it must be a regular file, not a symlink: copy the file itself there (`cp -L`)"
               if os.path.islink(path) else "let the service's user read it")
        raise ValueError(f"model.init_from: {path} cannot be read ({e.strerror}); {why}") from None
    except NotRegularFile:
        raise ValueError(f"model.init_from: {path} is not a regular file (a directory, pipe or device); "
                         f"{_FIX}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(CONFIG_MAX_BYTES + 1)
    if len(raw) > CONFIG_MAX_BYTES:
        raise ValueError(f"model.init_from: {path} is over {CONFIG_MAX_BYTES} bytes, too big for a Hugging Face "
                         f"config.json; {_FIX}")
    if not any(Path(directory).glob("*.safetensors")):
        raise ValueError(f"model.init_from: {directory!r} has no *.safetensors file")
    try:
        hf = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"model.init_from: {path} is not valid JSON ({e}); {_FIX}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"model.init_from: {path} holds a JSON {type(hf).__name__}, not the object of a model's "
                         f"settings; {_FIX}")
    return hf


class _Config:
    """Typed reads of one ``config.json``: a wrong value is a ``ValueError`` naming the file and the key."""

    def __init__(self, path: str, hf: dict[str, Any]) -> None:
        self.path, self.hf = path, hf

    def bad(self, key: str, value: Any, why: str, fix: str = _FIX) -> ValueError:
        return ValueError(f"model.init_from: {self.path} has {key}={reprlib.repr(value)}: {why}; {fix}")

    def whole(self, key: str, field: str | None, default: Any = MISSING) -> int:
        """A whole number (``default`` when absent or null), within the bounds of :class:`ModelConfig`'s
        ``field`` (``None``: at least 1)."""
        value = self.hf.get(key)
        if value is None:
            if default is MISSING:
                raise ValueError(f"model.init_from: {self.path} has no {key}, which every Llama config.json gives; "
                                 f"{_FIX}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(key, value, "it must be a whole number")
        self.check_bounds(key, field, value)
        return value

    def number(self, key: str, field: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.bad(key, value, "it must be a finite number")
        self.check_bounds(key, field, value)
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.hf.get(key, default)
        if not isinstance(value, bool):
            raise self.bad(key, value, "it must be true or false")
        return value

    def check_bounds(self, key: str, field: str | None, value: Any) -> None:
        if field is None:
            if value < 1:
                raise self.bad(key, value, "it must be >= 1")
            return
        try:
            bounds_of(ModelConfig, field).check(f"Meridian's model.{field}", value)
        except ValueError as e:
            raise self.bad(key, value, str(e), "fix the file, or start from a checkpoint Meridian can build") from None


def model_config_from_hf(directory: str, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint in ``directory`` (``init_from`` set to it); ``overrides``
    (e.g. a shorter ``seq_len``) replace the checkpoint's values. A ``config.json`` that is not one of a Llama
    model Meridian can build is a ``ValueError`` naming the file and the key."""
    hf = read_hf_config(directory)
    c = _Config(os.path.join(directory, "config.json"), hf)
    archs, model_type = hf.get("architectures"), hf.get("model_type")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise c.bad("architectures", archs, 'it must be a list of class names such as ["LlamaForCausalLM"]')
    if model_type is not None and not isinstance(model_type, str):
        raise c.bad("model_type", model_type, 'it must be a name such as "llama"')
    named = [*(archs or []), *([model_type] if model_type else [])]
    unsupported = [n for n in named if n not in ("LlamaForCausalLM", "llama")]
    if not named or unsupported:
        raise ValueError(f"model.init_from: {c.path} names architecture "
                         f"{', '.join(map(reprlib.repr, unsupported)) or '(none: no architectures, no model_type)'}; only "
                         'LlamaForCausalLM (model_type "llama") is supported')
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise c.bad(rope_key, rope, "it must be an object")
    if (kind := rope.get("rope_type", rope.get("type", "default"))) != "default":
        raise ValueError(f"model.init_from: {c.path} asks for RoPE scaling {reprlib.repr(kind)}, which is not "
                         "supported (only the default RoPE is)")
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if hf.get(key, ok) != ok:
            raise ValueError(f"model.init_from: {c.path} has {key}={reprlib.repr(hf[key])}; only {ok!r} is "
                             "supported")
    d, heads = c.whole("hidden_size", "d_model"), c.whole("num_attention_heads", "n_heads")
    kv_heads = c.whole("num_key_value_heads", "n_kv_heads", heads)
    if d % heads:
        raise c.bad("hidden_size", d, f"it must be a multiple of num_attention_heads ({heads})")
    if heads % kv_heads:
        raise c.bad("num_attention_heads", heads, f"it must be a multiple of num_key_value_heads ({kv_heads})")
    if hf.get("head_dim") not in (None, d // heads):
        raise c.bad("head_dim", hf["head_dim"], f"it must be hidden_size / num_attention_heads ({d // heads})")
    kwargs: dict[str, Any] = dict(
        family=ModelFamily.LLAMA, n_layers=c.whole("num_hidden_layers", "n_layers"), d_model=d, n_heads=heads,
        n_kv_heads=kv_heads, ffn_hidden=c.whole("intermediate_size", "ffn_hidden"),
        seq_len=min(c.whole("max_position_embeddings", None, 2048), 32768),
        vocab_size=c.whole("vocab_size", "vocab_size"),
        rope_theta=c.number("rope_theta", "rope_theta", rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=c.number("rms_norm_eps", "norm_eps", hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=c.flag("tie_word_embeddings", False), init_from=str(Path(directory).resolve()),
    )
    try:
        return ModelConfig(**{**kwargs, **overrides})
    except ValueError as e:  # what only the whole shape shows (RoPE needs an even head size, ...)
        raise ValueError(f"model.init_from: {c.path} describes a model Meridian cannot build: {e}") from None


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
