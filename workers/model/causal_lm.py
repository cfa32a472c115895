"""The one interface of every model Meridian trains: builtin presets, Hugging Face models, user factories.

A :class:`CausalLM` is an ``nn.Module`` whose parameter names are the names its checkpoints use, and which gives
the parallelism code what it wraps and the loop what it calls:

    transformer_blocks()  the repeated blocks (one ``nn.ModuleList``): FSDP2 wraps one ``fully_shard`` per block,
                          activation checkpointing and ``torch.compile`` work per block
    forward(idx)          (batch, time) token ids → (batch, time, vocab) logits
    forward(idx, targets) → (batch,) mean next-token loss of each sample, the head applied in chunks of the time
                          axis so no fp32 logits of the whole micro-batch exist at once (:func:`chunked_loss`)
    forward(idx, hidden=True) → (batch, time, d_model) final hidden states (after the final norm), and
    output_head()         the module that makes logits of them: a caller can compute the loss its own way
    tp_plan               module-name pattern → tensor-parallel style, or ``None`` (:mod:`meridian.workers.parallel.tp_plan`)
    export_name(name)     the name a parameter has in the family's own Hugging Face checkpoint

Every call goes through ``forward`` (the root module's ``__call__``), so wrappers that hook the root (DDP,
FSDP2's lazy init and all-gathers) see every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LOSS_CHUNK_BYTES = 64 << 20
"""The fp32 logits :func:`chunked_loss` materialises at once. Llama-3-8B's head at micro-batch 1 and 2,048 tokens
makes 1 GB of fp32 logits and as much again for their gradient; in 64 MiB chunks it keeps one chunk, recomputed
in backward. A micro-batch whose logits fit in one chunk runs exactly the unchunked loss (same ops, same bits)."""


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample: (batch, time, vocab), (batch, time) → (batch,)."""
    b, t, v = logits.shape
    loss = F.cross_entropy(logits.float().reshape(b * t, v), targets.reshape(b * t), reduction="none")
    return loss.view(b, t).mean(dim=1)


def _chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    b, t, v = logits.shape
    loss = F.cross_entropy(logits.float().reshape(b * t, v), targets.reshape(b * t), reduction="none")
    return loss.view(b, t).sum(dim=1)


def chunked_loss(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, vocab_size: int,
                 chunk_bytes: int = LOSS_CHUNK_BYTES) -> torch.Tensor:
    """:func:`per_sample_loss` of ``head(hidden)`` without holding the whole micro-batch's fp32 logits: the time
    axis is cut so each chunk's logits take at most ``chunk_bytes``, and each chunk's logits are recomputed in
    backward (activation checkpointing) instead of kept. (batch, time, d), (batch, time) → (batch,)."""
    b, t = targets.shape
    per_step = b * vocab_size * 4  # fp32 logits of one position of every sample
    if per_step * t <= chunk_bytes:
        return per_sample_loss(head(hidden), targets)
    step = max(1, chunk_bytes // per_step)
    total = torch.zeros(b, device=hidden.device, dtype=torch.float32)
    for s in range(0, t, step):
        total = total + checkpoint(_chunk_loss_sum, head, hidden[:, s:s + step], targets[:, s:s + step],
                                   use_reentrant=False)
    return total / t


class CausalLM(nn.Module):
    """Base of every model a job trains; subclasses give :meth:`hidden_states`, :meth:`output_head` and
    :meth:`transformer_blocks` (see the module's docstring for the whole interface)."""

    vocab_size: int

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """(batch, time) token ids → (batch, time, d_model) final hidden states, after the final norm."""
        raise NotImplementedError

    def output_head(self) -> nn.Module:
        """Final hidden states → logits."""
        raise NotImplementedError

    def transformer_blocks(self) -> nn.ModuleList:
        """The repeated transformer blocks, in order."""
        raise NotImplementedError

    @property
    def tp_plan(self) -> dict[str, str] | None:
        """Tensor-parallel plan: module-name pattern (``*`` for a block's index) → style; ``None``: none."""
        return None

    def export_name(self, name: str) -> str:
        """The name parameter ``name`` has in the family's own Hugging Face checkpoint."""
        return name

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                hidden: bool = False) -> torch.Tensor:
        """Logits; with ``targets``, each sample's mean loss (:func:`chunked_loss`); with ``hidden``, the final
        hidden states."""
        h = self.hidden_states(idx)
        if hidden:
            return h
        if targets is None:
            return self.output_head()(h)
        return chunked_loss(h, self.output_head(), targets, self.vocab_size)


def block_type(model: CausalLM) -> type[nn.Module]:
    """The class of ``model``'s repeated block."""
    return type(model.transformer_blocks()[0])


def find_blocks(root: nn.Module, names: set[str] | frozenset[str] = frozenset()) -> nn.ModuleList:
    """The ``nn.ModuleList`` of ``root``'s repeated blocks: the one whose items are all of a class named in
    ``names`` when given, else the one of a single class holding the most parameters. ``ValueError`` saying what
    was looked for when there is none (or, by name, more than one)."""
    lists = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    uniform = [(n, m) for n, m in lists if len({type(x) for x in m}) == 1]
    if names:
        hits = [(n, m) for n, m in uniform if type(m[0]).__name__ in names]
        if len(hits) != 1:
            found = ", ".join(f"{n} ({len(m)} x {type(m[0]).__name__})" for n, m in uniform) or "none"
            raise ValueError(f"the model has {'no' if not hits else 'more than one'} nn.ModuleList of blocks of class "
                             f"{' or '.join(sorted(names))} (its lists of one class: {found}); name the block class "
                             "its layers are made of")
        return hits[0][1]
    if not uniform:
        raise ValueError("the model holds no nn.ModuleList of blocks of one class: keep its transformer blocks in "
                         "one nn.ModuleList (FSDP, activation checkpointing and compile work per block)")
    return max(uniform, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))[1]


def alias_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names that share one tensor (tied weights), the name ``named_parameters`` keeps first."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


__all__ = ["LOSS_CHUNK_BYTES", "CausalLM", "alias_groups", "block_type", "chunked_loss", "find_blocks",
           "per_sample_loss"]
