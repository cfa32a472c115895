"""``meridian export``: a job's checkpoint (:mod:`meridian.workers.state.checkpoint`) as a Hugging Face directory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from meridian.workers.contracts.fields import from_plain
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.model.build import build_model
from meridian.workers.model.hf import save_hf
from meridian.workers.state.checkpoint import STATE_FILE


def export_checkpoint(checkpoint: str, model: dict, out: str) -> Path:
    """Write the weights of the checkpoint folder ``checkpoint`` (:mod:`meridian.workers.state.checkpoint`)
    of a model described by ``model`` (a plain :class:`ModelConfig`) as a Hugging Face directory ``out``."""
    cfg = from_plain(ModelConfig, model)
    state = torch.load(Path(checkpoint) / STATE_FILE, map_location="cpu", weights_only=False)["model"]
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in build_model(replace(cfg, init_from="")).named_parameters()}
    for name, shape in shapes.items():
        if name not in state or tuple(state[name].shape) != shape:
            got = tuple(state[name].shape) if name in state else "missing"
            raise ValueError(f"{checkpoint} holds {name} as {got}, the full model has {shape}: it is one "
                             "model-parallel rank's slice, which cannot be exported yet")
    return save_hf(out, cfg, state)
