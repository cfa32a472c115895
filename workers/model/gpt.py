"""A small GPT: the model every Meridian job trains.

GPT-2 shape (pre-LayerNorm blocks, GELU MLP, learned positions, untied output head) so parameter counts
and FLOPs follow the usual formulas (:class:`meridian.workers.contracts.config.ModelConfig`). A
:class:`~meridian.workers.model.causal_lm.CausalLM` with no distributed code: the sync engine wraps it from
outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.model.causal_lm import CausalLM, per_sample_loss


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]  # (batch, time, d_model)
        # the heads this module holds (all of them; a tensor-parallel rank's share): q, k, v each (b, t, h·hd)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (b, t, h·hd) → (b, h, t, hd)
        heads = q.shape[-1] // self.head_dim  # from the width, not -1: an empty micro-batch has none to infer
        q, k, v = (z.reshape(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, cfg.vocab_size
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layers) so the residual stream's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * cfg.n_layers) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(batch, time) token ids → (batch, time, d_model): the first pipeline stage's input layer."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def output_head(self) -> nn.Module:
        return self.head

    def transformer_blocks(self) -> nn.ModuleList:
        return self.blocks

    def export_name(self, name: str) -> str:
        from meridian.workers.model.hf import hf_name

        return hf_name(self.cfg, name)


__all__ = ["GPT", "per_sample_loss"]
