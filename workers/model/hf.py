"""Hugging Face weights in and out: Meridian parameter names ↔ ``LlamaForCausalLM`` / ``GPT2LMHeadModel``.

Llama maps one to one (same shapes; RoPE already uses HF's half-rotation). GPT-2's ``Conv1D`` layers store
weights as (in, out), so Meridian's ``nn.Linear`` weights are transposed on the way out. The config side is
torch-free: :mod:`meridian.workers.contracts.hf_config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from meridian.workers.contracts.hf_config import hf_config_of
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily

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


def from_hf(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Meridian-named tensors of an HF checkpoint's ``tensors``; a missing one is an error naming it."""
    out = {}
    for ours, theirs, t in _table(cfg):
        if theirs not in tensors:
            raise ValueError(f"model.init_from: the checkpoint has no tensor {theirs!r}")
        w = tensors[theirs]
        out[ours] = w.t() if t else w
    return out


def read_safetensors(directory: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@torch.no_grad()
def load_into(model: nn.Module, directory: str) -> None:
    """Copy the HF checkpoint in ``directory`` into ``model`` (a full model of the same shape)."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    weights = from_hf(cfg, read_safetensors(directory))
    params = dict(model.named_parameters())
    for name, p in params.items():
        w = weights[name]
        if tuple(w.shape) != tuple(p.shape):
            raise ValueError(f"model.init_from: {name} has shape {tuple(w.shape)} in {directory!r}, the model "
                             f"expects {tuple(p.shape)}")
        p.copy_(w.to(p.dtype))


def save_hf(directory: str, cfg: ModelConfig, params: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` that ``AutoModelForCausalLM.from_pretrained`` loads."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf(cfg, params)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_of(cfg), indent=2) + "\n")
    return out


__all__ = ["from_hf", "load_into", "read_safetensors", "save_hf", "to_hf"]
