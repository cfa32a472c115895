"""Hugging Face names of Meridian's own families: parameter names ↔ ``LlamaForCausalLM`` / ``GPT2LMHeadModel``.

Llama maps one to one (same shapes; RoPE already uses HF's half-rotation). GPT-2's ``Conv1D`` layers store
weights as (in, out), so Meridian's ``nn.Linear`` weights are transposed on the way out. The config side is
torch-free: :mod:`meridian.workers.contracts.hf_config`; the files: :mod:`meridian.workers.model.weights`.
"""

from __future__ import annotations

import torch
from torch import nn

from meridian.workers.contracts.model_config import ModelConfig, ModelFamily
from meridian.workers.model.weights import load_checkpoint

# (Meridian name, HF name, transposed): ``{i}`` is the block index.
_LLAMA = [
    ("tok_emb.weight", "model.embed_tokens.weight", False),
    ("blocks.{i}.ln1.weight", "model.layers.{i}.input_layernorm.weight", False),
    ("blocks.{i}.attn.q.weight", "model.layers.{i}.self_attn.q_proj.weight", False),
    ("blocks.{i}.attn.k.weight", "model.layers.{i}.self_attn.k_proj.weight", False),
    ("blocks.{i}.attn.v.weight", "model.layers.{i}.self_attn.v_proj.weight", False),
    ("blocks.{i}.attn.proj.weight", "model.layers.{i}.self_attn.o_proj.weight", False),
    ("blocks.{i}.ln2.weight", "model.layers.{i}.post_attention_layernorm.weight", False),
    ("blocks.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate_proj.weight", False),
    ("blocks.{i}.mlp.up.weight", "model.layers.{i}.mlp.up_proj.weight", False),
    ("blocks.{i}.mlp.proj.weight", "model.layers.{i}.mlp.down_proj.weight", False),
    ("ln_f.weight", "model.norm.weight", False),
    ("head.weight", "lm_head.weight", False),
]
_GPT2 = [
    ("tok_emb.weight", "transformer.wte.weight", False),
    ("pos_emb.weight", "transformer.wpe.weight", False),
    *[(f"blocks.{{i}}.{m}.{p}", f"transformer.h.{{i}}.{h}.{p}", False)
      for m, h in (("ln1", "ln_1"), ("ln2", "ln_2")) for p in ("weight", "bias")],
    *[(f"blocks.{{i}}.{m}.weight", f"transformer.h.{{i}}.{h}.weight", True)
      for m, h in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                   ("mlp.proj", "mlp.c_proj"))],
    *[(f"blocks.{{i}}.{m}.bias", f"transformer.h.{{i}}.{h}.bias", False)
      for m, h in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                   ("mlp.proj", "mlp.c_proj"))],
    ("ln_f.weight", "transformer.ln_f.weight", False),
    ("ln_f.bias", "transformer.ln_f.bias", False),
    ("head.weight", "lm_head.weight", False),
]


def _table(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    rows = _LLAMA if cfg.family is ModelFamily.LLAMA else _GPT2
    out = []
    for ours, theirs, t in rows:
        if "{i}" in ours:
            out += [(ours.format(i=i), theirs.format(i=i), t) for i in range(cfg.n_layers)]
        else:
            out.append((ours, theirs, t))
    if cfg.tie_embeddings:
        out = [row for row in out if row[0] != "head.weight"]
    return out


def to_hf(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors of Meridian's full ``params`` (a model's named parameters or state dict)."""
    missing = [ours for ours, _, _ in _table(cfg) if ours not in params]
    if missing:
        raise ValueError(f"the weights lack {len(missing)} parameter(s) of the full model, e.g. {missing[:3]} "
                         "(a model-parallel rank's slice cannot be exported)")
    out = {}
    for ours, theirs, t in _table(cfg):
        w = params[ours].detach().float().cpu()
        out[theirs] = (w.t() if t else w).contiguous()
    return out


def hf_name(cfg: ModelConfig, name: str) -> str:
    """The Hugging Face name of Meridian's parameter ``name``."""
    return {ours: theirs for ours, theirs, _ in _table(cfg)}.get(name, name)


@torch.no_grad()
def load_into(model: nn.Module, directory: str) -> None:
    """Copy the ``LlamaForCausalLM`` checkpoint in ``directory`` into ``model`` (a full builtin llama of the same
    shape), tensor by tensor (:func:`~meridian.workers.model.weights.load_checkpoint`)."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    ours = {theirs: mine for mine, theirs, _ in _table(cfg)}
    if cfg.tie_embeddings:
        ours["lm_head.weight"] = "head.weight"  # a checkpoint that stores the tied head too
    load_checkpoint(model, directory, rename=lambda key: ours.get(key, f"(not a Llama tensor) {key}"),
                    describe=f"the Llama its config.json describes ({cfg.n_layers} layers, d_model {cfg.d_model})")


__all__ = ["hf_name", "load_into", "to_hf"]
