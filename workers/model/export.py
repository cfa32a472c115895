"""``meridian export``: a job's checkpoint (sharded, :mod:`meridian.workers.state.sharded_checkpoint`, or a single
file, :mod:`meridian.workers.state.checkpoint`) as a directory of the model's own family.

A Hugging Face model goes back as what it came in as: its own ``config.json`` (the job's ``hf_config``) and its
family's tensor names (transformers' renames reversed, :meth:`HFCausalLM.export_name`); a builtin family as the
transformers family with the same maths (``LlamaForCausalLM``, ``GPT2LMHeadModel``). Weights are written in the
checkpoint's precision (what training kept: fp32) or the one asked for (``bf16``), in safetensors shards of at most
``max_shard_bytes`` with transformers' index, beside a ``generation_config.json``; the job's tokenizer goes with
them and its special tokens (bos/eos/pad) into both configs. A factory's module has no Hugging Face family: its
weights are written under its own names with ``meridian_model.json`` (the factory and its arguments) instead of a
``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from meridian.workers.contracts.config import DataConfig
from meridian.workers.contracts.fields import from_plain, to_plain
from meridian.workers.contracts.hf_config import hf_config_of
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily
from meridian.workers.data.hf_tokenizer import CONFIG_FILE, SPECIALS_FILE, export_tokenizer
from meridian.workers.model.build import build_model
from meridian.workers.model.causal_lm import CausalLM
from meridian.workers.model.hf import to_hf
from meridian.workers.model.weights import save_sharded
from meridian.workers.state.checkpoint import read_state
from meridian.workers.state.sharded_checkpoint import is_sharded, load_full, open_checkpoint

TOKENIZER_FILES = ("tokenizer.json", CONFIG_FILE, SPECIALS_FILE)
"""What a tokenizer export writes (:func:`~meridian.workers.data.hf_tokenizer.export_tokenizer`)."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``--dtype``: the precisions an export writes."""
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Shards of at most 5 GB, the size the Hugging Face Hub's own tools split checkpoints at."""

TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
FACTORY_FILE = "meridian_model.json"
"""A factory model's export: the factory, its arguments and block class (what rebuilds the module)."""


def _blank(cfg: ModelConfig) -> CausalLM:
    """The model of ``cfg`` on the meta device: its parameter names, shapes and export names, nothing loaded."""
    with torch.device("meta"):
        return build_model(replace(cfg, init_from=""))


def export_checkpoint(checkpoint: str, model: dict, out: str, *, dtype: str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write the weights of the checkpoint folder (or URL) ``checkpoint`` (:mod:`meridian.workers.state.checkpoint`)
    of a model described by ``model`` (a plain :class:`ModelConfig`) into ``out``; nothing is written when the
    checkpoint is not of that model. ``dtype``: ``fp32`` or ``bf16`` (``None``: the checkpoint's own)."""
    cfg = from_plain(ModelConfig, model)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if is_sharded(checkpoint):  # each rank's shard (DCP): read whole tensors on this process
        state, _ = load_full(open_checkpoint(checkpoint))
    else:
        state = read_state(checkpoint)["model"]
    lm = _blank(cfg)
    for name, p in lm.named_parameters():
        shape = tuple(p.shape)
        if name not in state or tuple(state[name].shape) != shape:
            got = tuple(state[name].shape) if name in state else "missing"
            raise ValueError(f"{checkpoint} holds {name} as {got}, where the model given ({_shape_of(cfg)}) has "
                             f"{shape}: the checkpoint is of another model; export it with the model of the job that "
                             "wrote it")
    return save_hf(out, cfg, state, dtype=None if dtype is None else DTYPES[dtype], max_shard_bytes=max_shard_bytes,
                   lm=lm)


def _shape_of(cfg: ModelConfig) -> str:
    return (f"{cfg.family.value}, n_layers {cfg.n_layers}, d_model {cfg.d_model}, n_heads {cfg.n_heads}, "
            f"vocab_size {cfg.vocab_size}")


def save_hf(directory: str, cfg: ModelConfig, params: dict[str, torch.Tensor], *, dtype: torch.dtype | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, lm: CausalLM | None = None) -> Path:
    """Write ``params`` (the full model's, by Meridian's names) as the model's own family into ``directory``: its
    ``config.json``, ``generation_config.json`` and safetensors shards (:func:`save_sharded`) in ``dtype``
    (``None``: as they are)."""
    lm = lm if lm is not None else _blank(cfg)
    names = [n for n, _ in lm.named_parameters()]
    dtype = dtype or params[names[0]].dtype
    if cfg.family.is_builtin:
        tensors = to_hf(cfg, params)
    else:
        tensors = {lm.export_name(n): params[n].detach().cpu() for n in names}
    tensors = {k: t.to(dtype).contiguous() for k, t in tensors.items()}
    out = Path(directory)
    files = save_sharded(tensors, out, max_shard_bytes=max_shard_bytes)
    if cfg.family is ModelFamily.FACTORY:
        (out / FACTORY_FILE).write_text(json.dumps({"model": to_plain(cfg), "weights": files}, indent=2) + "\n")
        return out
    config = hf_config_of(cfg)
    if cfg.family is ModelFamily.HF and not config.get("architectures"):
        config["architectures"] = [lm.architecture]  # type: ignore[attr-defined]
    config["dtype"] = config["torch_dtype"] = DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    _write_configs(out, config)
    return out


def _write_configs(out: Path, config: dict[str, Any]) -> None:
    """``config.json``, and the ``generation_config.json`` of its special tokens."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"_from_model_config": True, **{k: config.get(k) for k in TOKEN_KEYS if config.get(k) is not None}}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def export_job(checkpoint: str, model: dict, data: dict, out: str, *, dtype: str | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """The weights of ``checkpoint`` and the tokenizer of the job's ``data`` (a plain :class:`DataConfig`) as
    one directory; the tokenizer part of the result says whether one was written, and if not why. With a
    tokenizer, ``config.json`` and ``generation_config.json`` name its special tokens (``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``) for generation."""
    path = export_checkpoint(checkpoint, model, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    tokenizer = export_tokenizer(from_plain(DataConfig, data), str(path),
                                 model_max_length=from_plain(ModelConfig, model).seq_len)
    stale = [n for n in TOKENIZER_FILES if (path / n).exists()] if not tokenizer["written"] else []
    if stale:  # an earlier export's (or anyone's): AutoTokenizer would load it beside weights it does not belong to
        tokenizer = {**tokenizer, "stale_files": stale, "reason": (
            f"{tokenizer['reason']}; {path} still holds {', '.join(stale)} from before, which "
            "transformers.AutoTokenizer would load for these weights although they are not this job's tokenizer: "
            "remove them, or export into an empty directory")}
    config_file = path / "config.json"
    if config_file.exists() and any(tokenizer.get(k) is not None for k in TOKEN_KEYS):
        config = json.loads(config_file.read_text())
        config.update({k: tokenizer[k] for k in TOKEN_KEYS if tokenizer.get(k) is not None})
        _write_configs(path, config)
    weights = sorted(p.name for p in path.iterdir() if p.name.endswith((".safetensors", ".index.json")))
    return {"out": str(path), "tokenizer": tokenizer, "weights": weights}
