"""Build the model a job trains (:class:`~meridian.workers.contracts.model_config.ModelFamily`), always as a
:class:`~meridian.workers.model.causal_lm.CausalLM`."""

from __future__ import annotations

from meridian.workers.contracts.model_config import ModelConfig, ModelFamily
from meridian.workers.model.causal_lm import CausalLM


def build_model(cfg: ModelConfig) -> CausalLM:
    """The full model of ``cfg``'s family, initialised from the current torch seed, or from ``cfg.init_from``'s
    Hugging Face checkpoint when one is named. Under ``torch.device("meta")``: shapes only, nothing loaded."""
    import torch

    if cfg.family is ModelFamily.HF:
        from meridian.workers.model.hf_lm import build_hf

        return build_hf(cfg, meta=torch.get_default_device().type == "meta")
    if cfg.family is ModelFamily.FACTORY:
        from meridian.workers.model.factory import build_factory

        return build_factory(cfg)
    from meridian.workers.model.gpt import GPT
    from meridian.workers.model.llama import Llama

    model: CausalLM = Llama(cfg) if cfg.family is ModelFamily.LLAMA else GPT(cfg)
    if cfg.init_from and torch.get_default_device().type != "meta":
        from meridian.workers.model.hf import load_into

        load_into(model, cfg.init_from)
    return model
