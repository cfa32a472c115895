"""Hugging Face ``config.json`` ↔ :class:`ModelConfig`, torch-free (the HTTP edge reads a checkpoint's shape).

Two ways in. :func:`hf_model_config`: any family of :data:`~meridian.workers.contracts.hf_shape.FAMILIES`
(Llama 3.x with its RoPE scaling, Mistral, Qwen2/3, GPT-NeoX/Pythia), built by transformers itself on the workers
(family ``hf``), from a checkpoint directory or from a ``config.json`` alone (random initialisation); a
checkpoint's tensors are counted from the safetensors headers at admission, so weights that are not of the model
the config describes (a Qwen2 config renamed to Llama: its q/k/v biases) are refused before any worker starts.
:func:`model_config_from_hf`: a ``LlamaForCausalLM`` with the default RoPE as Meridian's own ``llama`` family
(which pipeline stages can cut). Out: :func:`hf_config_of` (``LlamaForCausalLM`` and
``GPT2LMHeadModel``; Meridian's gpt has an untied head and exact GELU, real GPT-2 checkpoints tie the head and use
the tanh approximation, so they are refused on the way in rather than loaded subtly wrong). Weights:
:mod:`meridian.workers.model.weights`.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import struct
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from meridian.workers.contracts.fields import bounds_of
from meridian.workers.contracts.hf_shape import FAMILIES, shape_of, supported_families
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily
from meridian.workers.contracts.regular_files import NotRegularFile, open_regular

CONFIG_MAX_BYTES = 1 << 20
"""A Hugging Face ``config.json`` is a few KB; a bigger one is not read (it is not one, and reading it costs)."""

_FIX = "give init_from the directory transformers' save_pretrained wrote, with its own config.json"


def read_hf_config(directory: str, *, weights: bool = True, field: str = "model.init_from") -> dict[str, Any]:
    """The JSON object of ``directory``'s ``config.json``, opened as :func:`open_regular` does (a named pipe
    cannot hang the service, a symlink or device is refused); ``ValueError`` naming the file otherwise.
    ``weights``: the directory must hold ``*.safetensors`` too. ``field``: the job field errors name."""
    path = os.path.join(directory, "config.json")
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise ValueError(f"{field}: {directory!r} has no config.json (a local Hugging Face checkpoint "
                         "directory is expected; nothing is ever downloaded)") from None
    except OSError as e:
        why = ("it must be a regular file, not a symlink: copy the file itself there (`cp -L`)"
               if os.path.islink(path) else "let the service's user read it")
        raise ValueError(f"{field}: {path} cannot be read ({e.strerror}); {why}") from None
    except NotRegularFile:
        raise ValueError(f"{field}: {path} is not a regular file (a directory, pipe or device); "
                         f"{_FIX}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(CONFIG_MAX_BYTES + 1)
    if len(raw) > CONFIG_MAX_BYTES:
        raise ValueError(f"{field}: {path} is over {CONFIG_MAX_BYTES} bytes, too big for a Hugging Face "
                         f"config.json; {_FIX}")
    if weights and not any(Path(directory).glob("*.safetensors")):
        raise ValueError(f"{field}: {directory!r} has no *.safetensors file (to start from random weights, name "
                         "the directory in model.config instead)")
    try:
        hf = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{field}: {path} is not valid JSON ({e}); {_FIX}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{field}: {path} holds a JSON {type(hf).__name__}, not the object of a model's "
                         f"settings; {_FIX}")
    return hf


class _Config:
    """Typed reads of one ``config.json``: a wrong value is a ``ValueError`` naming the file and the key."""

    def __init__(self, path: str, hf: dict[str, Any], field: str = "model.init_from") -> None:
        self.path, self.hf, self.field = path, hf, field

    def bad(self, key: str, value: Any, why: str, fix: str = _FIX) -> ValueError:
        return ValueError(f"{self.field}: {self.path} has {key}={reprlib.repr(value)}: {why}; {fix}")

    def whole(self, key: str, field: str | None, default: Any = MISSING) -> int:
        """A whole number (``default`` when absent or null), within the bounds of :class:`ModelConfig`'s
        ``field`` (``None``: at least 1)."""
        value = self.hf.get(key)
        if value is None:
            if default is MISSING:
                raise ValueError(f"{self.field}: {self.path} has no {key}, which every config.json of a model "
                                 f"Meridian builds gives; {_FIX}")
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
    """The :class:`ModelConfig` of the Llama checkpoint in ``directory`` as Meridian's own ``llama`` family
    (``init_from`` set to it); ``overrides`` (e.g. a shorter ``seq_len``) replace the checkpoint's values. A
    ``config.json`` that is not one of a Llama model that family can be is a ``ValueError`` naming the file and the
    key (:func:`hf_model_config` builds every family with transformers instead)."""
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
        cfg = ModelConfig(**{**kwargs, **overrides})
    except ValueError as e:  # what only the whole shape shows (RoPE needs an even head size, ...)
        raise ValueError(f"model.init_from: {c.path} describes a model Meridian cannot build: {e}") from None
    check_checkpoint_holds(directory, hf)
    return cfg


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
"""RoPE variants transformers computes (its ``ROPE_INIT_FUNCTIONS``, and ``default``): an hf model's
``rope_parameters`` / ``rope_scaling`` must name one."""

SAFETENSORS_HEADER_MAX = 100 << 20
"""The largest safetensors header admission reads (the format's own limit): a header names each tensor's dtype,
shape and offsets, a few hundred KB for a real checkpoint."""

INDEX_FILE = "model.safetensors.index.json"
"""A sharded checkpoint's index: ``weight_map`` names the shard file of every tensor."""


def hf_model_config(directory: str, *, weights: bool, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` (family ``hf``) of the Hugging Face model whose ``config.json`` is in
    ``directory``: its shape for the planner and the file itself (``hf_config``) for the workers. ``weights``:
    the job starts from the directory's safetensors (``init_from``), whose tensors must add up to the model the
    config describes; else from random weights (``model.config``). ``overrides``: e.g. a shorter ``seq_len``.
    A file that is not one of a family Meridian builds is a ``ValueError`` naming the file and the key."""
    field = "model.init_from" if weights else "model.config"
    hf = read_hf_config(directory, weights=weights, field=field)
    c = _Config(os.path.join(directory, "config.json"), hf, field)
    model_type = _family_of(c)
    fam = FAMILIES[model_type]
    d, heads = c.whole("hidden_size", "d_model"), c.whole("num_attention_heads", "n_heads")
    kv_heads = c.whole("num_key_value_heads", "n_kv_heads", heads)
    layers, ffn = c.whole("num_hidden_layers", "n_layers"), c.whole("intermediate_size", "ffn_hidden")
    vocab = c.whole("vocab_size", "vocab_size")
    if hf.get("head_dim") is not None:
        c.whole("head_dim", None)
    elif d % heads and fam.head_dim is None:
        raise c.bad("hidden_size", d, f"it must be a multiple of num_attention_heads ({heads})")
    if heads % kv_heads:
        raise c.bad("num_attention_heads", heads, f"it must be a multiple of num_key_value_heads ({kv_heads})")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        c.flag(key, False)
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise c.bad(rope_key, rope, "it must be an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise c.bad(rope_key, rope, f"its rope_type must be one transformers computes ({', '.join(ROPE_TYPES)})")
    theta = rope.get("rope_theta", hf.get(fam.theta_key, hf.get("rope_theta", 10000.0)))
    canonical = json.dumps(hf, sort_keys=True, separators=(",", ":"))
    kwargs: dict[str, Any] = dict(
        family=ModelFamily.HF, n_layers=layers, d_model=d, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=ffn,
        seq_len=min(c.whole("max_position_embeddings", None, 2048), 32768), vocab_size=vocab,
        rope_theta=c.number(rope_key if "rope_theta" in rope else fam.theta_key, "rope_theta", theta),
        norm_eps=c.number(fam.eps_key, "norm_eps", hf.get(fam.eps_key, 1e-6)),
        tie_embeddings=c.flag("tie_word_embeddings", False), hf_config=canonical,
        init_from=str(Path(directory).resolve()) if weights else "",
    )
    try:
        cfg = ModelConfig(**{**kwargs, **overrides})
    except ValueError as e:
        raise ValueError(f"{field}: {c.path} describes a model Meridian cannot build: {e}") from None
    if weights:
        check_checkpoint_holds(directory, hf)
    return cfg


def _family_of(c: _Config) -> str:
    """The ``model_type`` of a config.json whose ``architectures`` and ``model_type`` name one family of
    :data:`FAMILIES` (and agree); a ``ValueError`` naming what it names otherwise."""
    archs, model_type = c.hf.get("architectures"), c.hf.get("model_type")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise c.bad("architectures", archs, 'it must be a list of class names such as ["LlamaForCausalLM"]')
    if model_type is not None and not isinstance(model_type, str):
        raise c.bad("model_type", model_type, 'it must be a name such as "llama"')
    by_arch = {f.architecture: t for t, f in FAMILIES.items()}
    types = {*(by_arch.get(a, a) for a in archs or []), *([model_type] if model_type else [])}
    if len(types) != 1 or next(iter(types)) not in FAMILIES:
        named = [*(archs or []), *([model_type] if model_type else [])]
        raise ValueError(f"{c.field}: {c.path} names architecture "
                         f"{', '.join(map(reprlib.repr, named)) or '(none: no architectures, no model_type)'}; "
                         f"Meridian builds these Hugging Face families: {supported_families()}")
    return next(iter(types))


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint: those its index names (sharded), else every ``*.safetensors``."""
    index = os.path.join(directory, INDEX_FILE)
    if not os.path.lexists(index):
        return sorted(str(p) for p in Path(directory).glob("*.safetensors"))
    body = _read_json(index, CONFIG_MAX_BYTES * 64)
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"model.init_from: {index} has no weight_map object of tensor name → file name")
    names = sorted(set(weight_map.values()))
    for name in names:
        if os.path.basename(name) != name or not name.endswith(".safetensors"):
            raise ValueError(f"model.init_from: {index} names {name!r}, not a plain *.safetensors file name of its "
                             "directory")
    return [os.path.join(directory, n) for n in names]


def read_safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor of the safetensors file ``path`` as (dtype, shape), read from its header alone (the first
    8 bytes give the header's length); a ``ValueError`` naming the file when it is not one."""
    try:
        fd = open_regular(path)
    except (OSError, NotRegularFile) as e:
        raise ValueError(f"model.init_from: {path} cannot be read as a regular file ({e}); copy the checkpoint's "
                         "files themselves there, not links to them") from None
    with os.fdopen(fd, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= SAFETENSORS_HEADER_MAX:
            raise ValueError(f"model.init_from: {path} is not a safetensors file (its first 8 bytes give no header "
                             "length); write it with safetensors or save_pretrained")
        raw = f.read(size)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"model.init_from: {path} has no valid safetensors header ({e})") from None
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, info in header.items() if isinstance(header, dict) else [("", None)]:
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if (not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                   for n in shape)):
            raise ValueError(f"model.init_from: {path} has no valid safetensors header (tensor {name!r})")
        out[name] = (str(info.get("dtype")), tuple(shape))
    return out


def check_checkpoint_holds(directory: str, hf: dict[str, Any]) -> None:
    """The checkpoint's tensors (from their headers) add up to the model ``hf`` describes (a tied head stored
    twice allowed): weights of another family, or with biases the config does not declare, are refused here,
    before any worker reads a byte of them."""
    shape = shape_of(hf)
    files = checkpoint_files(directory)
    numel = sum(math.prod(s) for f in files for _, s in read_safetensors_header(f).values())
    allowed = {shape.num_params} | ({shape.num_params + shape.embedding_params} if shape.tie_embeddings else set())
    if numel not in allowed:
        raise ValueError(
            f"model.init_from: {directory} holds {numel:,} weights in {len(files)} safetensors file(s), but its "
            f"config.json describes a {shape.architecture} of {shape.num_params:,} parameters: these are not that "
            "model's weights (a config.json of another family or copied from another checkpoint would load them "
            f"wrong, e.g. dropping q/k/v biases); {_FIX}")


def _read_json(path: str, limit: int) -> Any:
    try:
        fd = open_regular(path)
    except (OSError, NotRegularFile) as e:
        raise ValueError(f"model.init_from: {path} cannot be read as a regular file ({e})") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"model.init_from: {path} is over {limit} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"model.init_from: {path} is not valid JSON ({e})") from None


def hf_config_of(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` with which ``transformers`` builds the same model as ``cfg``: an hf model's own file,
    a builtin family's equivalent (a factory's module has none: ``ValueError``)."""
    if cfg.family is ModelFamily.HF:
        return json.loads(cfg.hf_config)
    if cfg.family is ModelFamily.FACTORY:
        raise ValueError(f"model.factory {cfg.factory}: a factory's module has no Hugging Face config.json")
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
