"""The Llama family: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention, no biases.

Same outer shape as :class:`meridian.workers.model.gpt.GPT` (``tok_emb``, ``blocks.{i}.{ln1,attn,ln2,mlp}``,
``ln_f``, ``head``) so pipeline stages, tensor-parallel slicing and checkpoints treat both families alike;
the residual projections are called ``proj`` in both. RoPE rotates the two halves of each head
(``rotate_half``), the convention of Hugging Face's ``LlamaForCausalLM``, so its weights load unpermuted
(:mod:`meridian.workers.model.hf`). Key/value head ``j`` serves query heads ``j * n_rep … (j + 1) * n_rep - 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.model.causal_lm import CausalLM


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(t: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), each (t, head_dim), halves repeated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    freqs = torch.outer(torch.arange(t, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, theta: float
) -> torch.Tensor:
    """Causal attention of projected (b, t, heads·hd) queries and (b, t, kv_heads·hd) keys and values, with
    RoPE; returns (b, t, heads·hd)."""
    b, t, width = q.shape
    hd = width // heads  # explicit, not -1: an empty micro-batch (b = 0) has no size to infer it from
    q = q.view(b, t, heads, hd).transpose(1, 2)
    k = k.view(b, t, kv_heads, hd).transpose(1, 2)
    v = v.view(b, t, kv_heads, hd).transpose(1, 2)
    cos, sin = rope_tables(t, q.shape[-1], theta, q.device)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, t, heads * hd)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.theta = cfg.n_heads, cfg.kv_heads, cfg.rope_theta
        self.head_dim = cfg.head_dim
        kv = cfg.kv_heads * cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, kv, bias=False)
        self.v = nn.Linear(cfg.d_model, kv, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        # Heads from the projections' widths, not the config: under tensor parallelism
        # (:mod:`meridian.workers.parallel.tp_plan`) q/k/v hold this rank's heads only.
        heads, kv_heads = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        return self.proj(attend(q, k, v, heads, kv_heads, self.theta))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_width, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_width, bias=False)
        self.proj = nn.Linear(cfg.mlp_width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Llama(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, cfg.vocab_size
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # depth-scaled residual projections, as in GPT
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * cfg.n_layers) ** 0.5)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(batch, time) token ids → (batch, time, d_model): the first pipeline stage's input layer."""
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than model.seq_len={self.cfg.seq_len}")
        return self.tok_emb(idx)

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
