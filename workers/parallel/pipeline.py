"""Pipeline parallelism with ``torch.distributed.pipelining``: this rank's model chunks and the schedule that runs
a step's micro-batches through every replica's stages.

A replica's blocks are cut into ``stages = pp × virtual_stages`` consecutive stages (:func:`stage_layers`); stage
``g`` runs on pipeline rank ``g mod pp`` (torch's looped placement), so with virtual stages rank ``s`` holds the
chunks ``s, s + pp, …`` and interleaved 1F1B runs them. One optimizer step::

    schedule.step      every micro-batch: forward through the stages, the last one's loss (its share of the
                       global-batch mean: gradients are summed, never scaled by the schedule), backward; the
                       schedule keeps FSDP2 from reducing until the last micro-batch's backward, then reduces
                       each chunk's gradients (FSDP2's reduce-scatter inside the datacenter, whose hook starts the
                       engine's inter-DC sum: :mod:`meridian.workers.sync.fsdp_har`)

Stage boundaries exchange hidden states forward and their gradients backward, point to point between the ranks of
one replica with the same tensor-parallel rank (with sequence parallelism each sends its shard of the sequence).
When the two ranks sit in different datacenters these messages cross the inter-DC link: :class:`CountingStage`
counts the bytes of every tensor it sends across one. The schedules own the backward call; FSDP2's hooks are what
the hierarchical sync needs of it, so nothing of Meridian's runs inside them.

:class:`StageModel` holds this rank's chunks with the whole model's parameter names (``blocks.<i>`` of its own
blocks, ``tok_emb`` on the first stage, ``ln_f`` and ``head`` on the last), so optimizer state, snapshots and
checkpoints name parameters as a one-process job does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from meridian.workers.contracts.config import ParallelConfig, PipelineSchedule
from meridian.workers.model.causal_lm import per_sample_loss


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """Blocks of pipeline stage ``stage`` of ``stages``: contiguous, counts differing by at most one, extras first."""
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def rank_stages(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in order: ``pp_rank, pp_rank + pp, …``."""
    return list(range(pp_rank, parallel.stages, parallel.pp))


class Chunk(nn.Module):
    """One pipeline stage of a model of the builtin families: its blocks, the embeddings on the first stage, the
    final norm and head on the last. Holds the whole model's modules (shared, not copied)."""

    def __init__(self, full: nn.Module, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = full.cfg
        self.first, self.last = first, last
        self._embed = type(full).embed  # reads the embeddings below by the full model's attribute names
        if first:
            self.tok_emb = full.tok_emb
            if hasattr(full, "pos_emb"):
                self.pos_emb = full.pos_emb
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in layers})
        if last:
            self.ln_f, self.head = full.ln_f, full.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: (batch, time) token ids; later stages: hidden states. Returns hidden states, or
        (batch, time, vocab) logits on the last stage."""
        if self.first:
            x = self._embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x



class StageModel(nn.Module):
    """This rank's chunks of the model, its parameters named as in the whole model. ``chunks`` are not registered
    as submodules (their modules are this module's own), so the names carry no chunk prefix."""

    def __init__(self, full: nn.Module, stages: Sequence[int], n_stages: int) -> None:
        super().__init__()
        n_layers = len(full.blocks)
        chunks = [Chunk(full, stage_layers(n_layers, n_stages, g), first=g == 0, last=g == n_stages - 1)
                  for g in stages]  # fmt: skip
        self.stage_ids = list(stages)
        for name in ("tok_emb", "pos_emb", "ln_f", "head"):
            held = [getattr(c, name) for c in chunks if hasattr(c, name)]
            if held:
                setattr(self, name, held[0])
        self.blocks = nn.ModuleDict({k: b for c in chunks for k, b in c.blocks.items()})
        self.chunks: list[Chunk] = chunks

    @property
    def has_last(self) -> bool:
        return self.chunks[-1].last

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The whole model, when this rank holds every stage (no pipeline): logits, or with ``targets`` each
        sample's mean loss, as a :class:`~meridian.workers.model.causal_lm.CausalLM` answers."""
        for chunk in self.chunks:
            x = chunk(x)
        return x if targets is None else per_sample_loss(x, targets)


class CountingStage(PipelineStage):
    """A pipeline stage that counts the bytes of the activations and gradients it sends to a rank in another
    datacenter (``datacenters``: every world rank's)."""

    def __init__(self, *args, datacenters: Sequence[str], **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.datacenters = tuple(datacenters)
        self.mine = self.datacenters[dist.get_rank()]
        self.cross_dc_bytes = 0

    def _count(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        for op in ops:
            if self.datacenters[op.peer] != self.mine:
                self.cross_dc_bytes += op.tensor.numel() * op.tensor.element_size()
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_bwd_send_ops(bwd_chunk_id))


def build_schedule(
    stages: list[CountingStage], parallel: ParallelConfig, n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):  # noqa: ANN201 - torch's schedule classes share no public base
    """The job's schedule over this rank's stages; ``loss_fn`` returns a micro-batch's share of the global-batch
    loss (summed, not averaged: the schedule does not scale the gradients)."""
    if parallel.schedule is PipelineSchedule.INTERLEAVED_1F1B:
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    kind = Schedule1F1B if parallel.schedule is PipelineSchedule.ONE_F_ONE_B else ScheduleGPipe
    (stage,) = stages
    return kind(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)


@torch.no_grad()
def forward_only(
    model: StageModel, x: torch.Tensor, *, n_stages: int, pp: int, pp_rank: int, group: dist.ProcessGroup,
    hidden: tuple[int, ...], dtype: torch.dtype, device: torch.device,
) -> torch.Tensor | None:
    """One micro-batch through every stage, forward only, stage after stage (an evaluation's: rare, so the
    pipeline does not overlap micro-batches). ``hidden``: the shape of the hidden states a stage passes on (of
    ``dtype``). Returns the logits on the rank holding the last stage, else ``None``."""
    chunks = dict(zip(model.stage_ids, model.chunks, strict=True))
    carry: torch.Tensor | None = None
    for g in range(n_stages):
        owner, nxt = g % pp, (g + 1) % pp
        if owner != pp_rank:
            if g + 1 < n_stages and nxt == pp_rank:  # the next stage is this rank's: receive its input
                carry = torch.empty(hidden, dtype=dtype, device=device)
                dist.recv(carry, group_src=owner, group=group)
            continue
        out = chunks[g](x.to(device) if g == 0 else carry)
        if g == n_stages - 1:
            return out
        if nxt != pp_rank:
            dist.send(out.to(dtype).contiguous(), group_dst=nxt, group=group)
        carry = out
    return None
