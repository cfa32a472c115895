"""Megatron-style tensor parallelism of the transformer blocks (both families), and the pipeline stage a rank
holds.

Each block's attention and MLP are split over the TP group (Shoeybi et al. 2019, "Megatron-LM", §3)::

    x ─ copy ─> qkv (column-parallel: this rank's heads) ─> attention ─> proj (row-parallel) ─ reduce ─> + bias
    x ─ copy ─> fc  (column-parallel: 1/tp of the width) ─> GELU      ─> proj (row-parallel) ─ reduce ─> + bias

Llama blocks the same way without biases: ``q``, ``k``, ``v`` column-parallel by heads (rank r holds query
heads r·h/tp… and key/value heads r·kv/tp…, which are exactly the key/value heads its query heads use, since
``tp`` divides ``n_kv_heads``), ``gate`` and ``up`` column-parallel, both ``proj`` row-parallel.

``copy`` is the identity forward and an all-reduce of the input gradient backward; ``reduce`` is an
all-reduce forward and the identity backward: two all-reduces per layer forward, two backward. Everything
else (LayerNorms, embeddings, head, the row-parallel biases) is replicated on every TP rank and gets the
same gradient on each, so the data-parallel sync needs no TP step.

Hand-written rather than DTensor's ``parallelize_module``: the sync engines flatten plain parameters into
buckets (:mod:`meridian.workers.sync.grad_buffer`) and shard them across DCs; DTensor parameters would need a
second code path through all of it. A sliced parameter keeps the single-process name, so the optimizer's
decay groups, checkpoints and :func:`unshard` work by name.

The stage module is cut from a full model (:func:`~meridian.workers.model.build.build_model`) built with the
job's seed, so every layout starts from the single-process initial weights.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meridian.workers.model.gpt import Block
from meridian.workers.model.llama import LlamaBlock, attend

Split = Literal["qkv", "rows", "cols"]


def tp_split(name: str) -> Split | None:
    """How parameter ``name`` is cut across TP ranks; ``None``: replicated."""
    if ".attn.qkv." in name:
        return "qkv"  # rows of q, k and v, each cut by heads
    if ".mlp.fc." in name or name.endswith((".attn.q.weight", ".attn.k.weight", ".attn.v.weight",
                                             ".mlp.gate.weight", ".mlp.up.weight")):
        return "rows"  # output features (llama's q, k, v: whole heads, tp dividing n_kv_heads)
    if name.endswith((".attn.proj.weight", ".mlp.proj.weight")):
        return "cols"  # input features
    return None


def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of the full parameter ``name``."""
    split = tp_split(name)
    if split is None or tp == 1:
        return full.clone()
    if split == "qkv":
        return torch.cat([part.chunk(tp, dim=0)[tp_rank] for part in full.chunk(3, dim=0)], dim=0).clone()
    return full.chunk(tp, dim=0 if split == "rows" else 1)[tp_rank].clone()


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full parameter ``name`` from every TP rank's part, in TP rank order (inverse of :func:`shard`)."""
    split = tp_split(name)
    if split is None or len(parts) == 1:
        return parts[0]
    if split == "qkv":
        qkv = [p.chunk(3, dim=0) for p in parts]
        return torch.cat([torch.cat([q[i] for q in qkv], dim=0) for i in range(3)], dim=0)
    return torch.cat(parts, dim=0 if split == "rows" else 1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad, None


class RowParallelLinear(nn.Module):
    """``x @ W_r.T`` summed over the TP group, then the (replicated) bias once, if any."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def _column(full: nn.Linear, name: str, tp_rank: int, tp: int) -> nn.Linear:
    w = shard(f"{name}.weight", full.weight.detach(), tp_rank, tp)
    out = nn.Linear(w.shape[1], w.shape[0], bias=full.bias is not None)
    out.weight = nn.Parameter(w)
    if full.bias is not None:
        out.bias = nn.Parameter(shard(f"{name}.bias", full.bias.detach(), tp_rank, tp))
    return out


def _row(full: nn.Linear, name: str, tp_rank: int, tp: int, group: dist.ProcessGroup) -> RowParallelLinear:
    bias = None if full.bias is None else full.bias.detach().clone()
    return RowParallelLinear(shard(f"{name}.weight", full.weight.detach(), tp_rank, tp), bias, group)


class TPAttention(nn.Module):
    def __init__(self, full: nn.Module, prefix: str, n_heads: int, tp_rank: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.heads = n_heads // tp  # this rank's heads
        self.group = group
        self.qkv = _column(full.qkv, f"{prefix}.qkv", tp_rank, tp)
        self.proj = _row(full.proj, f"{prefix}.proj", tp_rank, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(_CopyToTP.apply(x, self.group)).chunk(3, dim=2)  # each (b, t, d / tp)
        # (b, t, d / tp) → (b, heads / tp, t, head_dim)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class TPMLP(nn.Module):
    def __init__(self, full: nn.Module, prefix: str, tp_rank: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.fc = _column(full.fc, f"{prefix}.fc", tp_rank, tp)
        self.proj = _row(full.proj, f"{prefix}.proj", tp_rank, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(_CopyToTP.apply(x, self.group))))


class TPLlamaAttention(nn.Module):
    def __init__(self, full: nn.Module, prefix: str, tp_rank: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.theta = full.heads // tp, full.kv_heads // tp, full.theta
        self.group = group
        self.q, self.k, self.v = (_column(getattr(full, n), f"{prefix}.{n}", tp_rank, tp) for n in ("q", "k", "v"))
        self.proj = _row(full.proj, f"{prefix}.proj", tp_rank, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)
        return self.proj(attend(self.q(x), self.k(x), self.v(x), self.heads, self.kv_heads, self.theta))


class TPSwiGLU(nn.Module):
    def __init__(self, full: nn.Module, prefix: str, tp_rank: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.gate = _column(full.gate, f"{prefix}.gate", tp_rank, tp)
        self.up = _column(full.up, f"{prefix}.up", tp_rank, tp)
        self.proj = _row(full.proj, f"{prefix}.proj", tp_rank, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)
        return self.proj(F.silu(self.gate(x)) * self.up(x))


def tp_block(
    block: nn.Module, prefix: str, n_heads: int, tp_rank: int, tp: int, group: dist.ProcessGroup | None
) -> nn.Module:
    """``block`` (a GPT :class:`Block` or a :class:`LlamaBlock`) with its attention and MLP replaced by this
    rank's TP slices (in place)."""
    if tp == 1:
        return block
    assert group is not None
    if isinstance(block, LlamaBlock):
        block.attn = TPLlamaAttention(block.attn, f"{prefix}.attn", tp_rank, tp, group)
        block.mlp = TPSwiGLU(block.mlp, f"{prefix}.mlp", tp_rank, tp, group)
        return block
    assert isinstance(block, Block)
    block.attn = TPAttention(block.attn, f"{prefix}.attn", n_heads, tp_rank, tp, group)
    block.mlp = TPMLP(block.mlp, f"{prefix}.mlp", tp_rank, tp, group)
    return block


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """Blocks of pipeline stage ``stage``: contiguous, counts differing by at most one, extras first."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class GPTStage(nn.Module):
    """The part of a full model (either family) one rank runs: its stage's blocks (TP-sliced), plus the
    embeddings on the first stage and the final norm and head on the last. Parameter names are the full
    model's."""

    def __init__(
        self, full: nn.Module, *, stage: int, pp: int, tp_rank: int, tp: int, tp_group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        cfg = full.cfg
        self.cfg = cfg
        self.first, self.last = stage == 0, stage == pp - 1
        self._embed = type(full).embed  # reads the embeddings below by the full model's attribute names
        if self.first:
            self.tok_emb = full.tok_emb
            if hasattr(full, "pos_emb"):
                self.pos_emb = full.pos_emb
        self.blocks = nn.ModuleDict({
            str(i): tp_block(full.blocks[i], f"blocks.{i}", cfg.n_heads, tp_rank, tp, tp_group)
            for i in stage_layers(cfg.n_layers, pp, stage)
        })
        if self.last:
            self.ln_f, self.head = full.ln_f, full.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: (batch, time) token ids; later stages: (batch, time, d_model) hidden states.
        Returns hidden states, or (batch, time, vocab) logits on the last stage."""
        if self.first:
            x = self._embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def assemble(parts: dict[tuple[int, int], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One replica's full parameters from the named parameters of each (stage, tp_rank)."""
    tp = 1 + max(t for _, t in parts)
    out: dict[str, torch.Tensor] = {}
    for stage in sorted({s for s, _ in parts}):
        for name in parts[stage, 0]:
            out[name] = unshard(name, [parts[stage, t][name] for t in range(tp)])
    return out
