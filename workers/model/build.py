"""Build the model of a job's family (:class:`~meridian.workers.contracts.config.ModelFamily`)."""

from __future__ import annotations

from torch import nn

from meridian.workers.contracts.model_config import ModelConfig, ModelFamily


def build_model(cfg: ModelConfig) -> nn.Module:
    """The full model of ``cfg``'s family, initialised from the current torch seed, or from
    ``cfg.init_from``'s Hugging Face checkpoint when one is named."""
    from meridian.workers.model.gpt import GPT
    from meridian.workers.model.llama import Llama

    model: nn.Module = Llama(cfg) if cfg.family is ModelFamily.LLAMA else GPT(cfg)
    if cfg.init_from:
        from meridian.workers.model.hf import load_into

        load_into(model, cfg.init_from)
    return model
