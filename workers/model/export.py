"""``meridian export``: a job's checkpoint (sharded, :mod:`meridian.workers.state.sharded_checkpoint`, or a single
file, :mod:`meridian.workers.state.checkpoint`) as a Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from meridian.workers.contracts.config import DataConfig
from meridian.workers.contracts.fields import from_plain
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.data.hf_tokenizer import CONFIG_FILE, SPECIALS_FILE, export_tokenizer
from meridian.workers.model.build import build_model
from meridian.workers.model.hf import save_hf
from meridian.workers.state.checkpoint import read_state
from meridian.workers.state.sharded_checkpoint import is_sharded, load_full, open_checkpoint

TOKENIZER_FILES = ("tokenizer.json", CONFIG_FILE, SPECIALS_FILE)
"""What a tokenizer export writes (:func:`~meridian.workers.data.hf_tokenizer.export_tokenizer`)."""


def export_checkpoint(checkpoint: str, model: dict, out: str) -> Path:
    """Write the weights of the checkpoint folder (or URL) ``checkpoint`` (:mod:`meridian.workers.state.checkpoint`)
    of a model described by ``model`` (a plain :class:`ModelConfig`) as a Hugging Face directory ``out``."""
    cfg = from_plain(ModelConfig, model)
    if is_sharded(checkpoint):  # each rank's shard (DCP): read whole tensors on this process
        state, _ = load_full(open_checkpoint(checkpoint))
    else:
        state = read_state(checkpoint)["model"]
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in build_model(replace(cfg, init_from="")).named_parameters()}
    for name, shape in shapes.items():
        if name not in state or tuple(state[name].shape) != shape:
            got = tuple(state[name].shape) if name in state else "missing"
            raise ValueError(f"{checkpoint} holds {name} as {got}, where the model given ({_shape_of(cfg)}) has "
                             f"{shape}: the checkpoint is of another model; export it with the model of the job that "
                             "wrote it")
    return save_hf(out, cfg, state)


def _shape_of(cfg: ModelConfig) -> str:
    return (f"{cfg.family.value}, n_layers {cfg.n_layers}, d_model {cfg.d_model}, n_heads {cfg.n_heads}, "
            f"vocab_size {cfg.vocab_size}")


def export_job(checkpoint: str, model: dict, data: dict, out: str) -> dict:
    """The weights of ``checkpoint`` and the tokenizer of the job's ``data`` (a plain :class:`DataConfig`) as
    one Hugging Face directory; the tokenizer part of the result says whether one was written, and if not why.
    With a tokenizer, ``config.json`` names its end-of-text token (``eos_token_id``) for generation."""
    path = export_checkpoint(checkpoint, model, out)
    tokenizer = export_tokenizer(from_plain(DataConfig, data), str(path),
                                 model_max_length=from_plain(ModelConfig, model).seq_len)
    stale = [n for n in TOKENIZER_FILES if (path / n).exists()] if not tokenizer["written"] else []
    if stale:  # an earlier export's (or anyone's): AutoTokenizer would load it beside weights it does not belong to
        tokenizer = {**tokenizer, "stale_files": stale, "reason": (
            f"{tokenizer['reason']}; {path} still holds {', '.join(stale)} from before, which "
            "transformers.AutoTokenizer would load for these weights although they are not this job's tokenizer: "
            "remove them, or export into an empty directory")}
    if tokenizer["eos_token_id"] is not None:
        config_file = path / "config.json"
        config = json.loads(config_file.read_text())
        config["eos_token_id"] = tokenizer["eos_token_id"]
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    return {"out": str(path), "tokenizer": tokenizer}
