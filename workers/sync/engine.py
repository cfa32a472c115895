"""The interface every gradient-sync engine implements, and what a step reports.

Call order inside a training step (every rank)::

    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with engine.micro_batch(last_micro_batch=last):  # forward *and* backward inside
            loss = local_loss_sum(engine.model, x, y) / global_batch   # this rank's share of the global mean
            engine.backward(loss, last_micro_batch=last)
    stats = engine.step(lr)                             # sync, clip, AdamW, parameters equal everywhere

The loss each rank passes is its *share* of the global-batch mean, so summing gradients over ranks gives
exactly the single-process gradient however the samples are split (uneven shares included). Only the
last micro-batch communicates. ``micro_batch`` exists for DDP, which decides in *forward* whether the
next backward all-reduces (a forward outside ``no_sync`` makes the backward sync, whatever ``no_sync``
says around the backward). Engines live in :mod:`meridian.workers.sync.flat`,
:mod:`meridian.workers.sync.fsdp_har` and :mod:`meridian.workers.sync.diloco`; :func:`meridian.workers.sync.build.build_sync`
picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meridian.workers.state.replica_state import LocalShard
from meridian.workers.sync.lookahead_decision import LookaheadDecision


@dataclass(frozen=True)
class StepStats:
    grad_norm: float | torch.Tensor
    """Global gradient norm before clipping: a 0-d tensor on the rank's device where reading it would sync the
    host (a GPU); the loop's record reads it one step later."""
    inter_dc_bytes: int
    """Bytes this rank put into collectives that cross a datacenter boundary this step (compressed size)."""
    sync_wait_s: float
    """Seconds the training thread was blocked on communication this step (gradient sync not hidden behind
    backward, the clipping all-reduce, parameter all-gathers waited for)."""
    comm_s: float = 0.0
    """Seconds the gradient sync (HAR steps 1–2, or 1–3) spent in collectives, on whichever thread ran it,
    including waits for slower peers. 0 for the flat engine, whose collectives DDP runs out of sight."""
    exposed_s: float = 0.0
    """Seconds ``step`` blocked waiting for that gradient sync."""
    intra_dc_comm_s: float = 0.0
    """Of ``comm_s``: seconds the intra-DC reduce-scatters (HAR step 1) took on the comm thread; the rest is
    the inter-DC all-reduce (step 2) and its waits. 0 for the flat engine."""
    shard: LocalShard | None = None
    """What this rank owns of the updated state, when ``step(..., snapshot_as=n)``
    (:mod:`meridian.workers.state.replica_state`)."""
    late: bool = False
    """This step's sync is applied one step late (``delay_one_step``; with ``local_lookahead``, at a look-ahead)."""
    lookahead_decision: LookaheadDecision | None = None
    """Set on the step where an armed look-ahead was decided (``sync.lookahead_when_exposed``)."""

    @property
    def overlap_fraction(self) -> float:
        """Share of the gradient sync's busy time that ``step`` did not wait for: ``1 - exposed_s / comm_s``, in
        [0, 1]. A per-step indicator from this rank's timers, not the step time overlap saves (``comm_s`` counts
        waits for slower peers too); ``meridian bench lab`` measures that saving: the same job with overlap off."""
        if self.comm_s <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.exposed_s / self.comm_s))


BROADCAST_CHUNK_BYTES = 64 * 2**20
"""Parameters are broadcast in flat chunks of up to this many bytes (one dtype and device each)."""


def broadcast_parameters(
    model: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None, chunk_bytes: int = BROADCAST_CHUNK_BYTES
) -> None:
    """Make every replica start from (world) rank ``src``'s weights; ``group``: the data-parallel ranks.

    Coalesced: one broadcast per chunk of parameters, not per parameter. Each broadcast is a round trip of the
    group, on the critical path of every epoch's start (a re-formation's included): with nano's 29 parameters
    one at a time, a cold engine build on 3 ranks sharing two cores took 21-29 ms (6 builds), coalesced 5-24
    (9 builds; median 10); over a 21 ms inter-DC link each round trip would cost at least that link's RTT."""
    chunk: list[torch.Tensor] = []
    size = 0
    for p in model.parameters():
        nbytes = p.numel() * p.element_size()
        if chunk and ((p.dtype, p.device) != (chunk[0].dtype, chunk[0].device) or size + nbytes > chunk_bytes):
            _broadcast_flat(chunk, src, group)
            chunk, size = [], 0
        chunk.append(p.data)
        size += nbytes
    if chunk:
        _broadcast_flat(chunk, src, group)


def _broadcast_flat(tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    if len(tensors) == 1 and tensors[0].is_contiguous():
        dist.broadcast(tensors[0], src=src, group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.broadcast(flat, src=src, group=group)
    at = 0
    for t in tensors:
        t.copy_(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()


class GradientSync(ABC):
    """One data-parallel replica's side of the step: backward, sync, update."""

    model: nn.Module

    def micro_batch(self, *, last_micro_batch: bool) -> AbstractContextManager[object]:
        """Wrap one micro-batch's forward and backward."""
        return nullcontext()

    @abstractmethod
    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool) -> None:
        """Accumulate this micro-batch's gradients; on the last one, start the sync."""

    @abstractmethod
    def step(self, lr: float, *, snapshot_as: int | None = None, last: bool = False) -> StepStats:
        """Sync, clip and update. With ``snapshot_as`` (the training steps done after this one) also copy what
        this rank owns of the new state into ``StepStats.shard`` — before any parameter all-gather, so the
        copy never waits for communication. ``last``: the job's last step, where an engine whose replicas may
        differ between syncs (DiLoCo) can bring them together, the bytes counted in this step's stats."""

    @abstractmethod
    def local_shard(self, step: int) -> LocalShard:
        """What this rank owns of the current state (parameters and optimizer), as of ``step`` steps done."""

    @property
    def feedback_held(self) -> bool:
        """The engine carries state that :meth:`step`'s snapshots leave out and :meth:`local_shard` includes when
        no sync is in flight (compressed sync's error-feedback residuals): a durable checkpoint reads
        :meth:`local_shard`. Snapshots leave it out because they do not keep it
        (:func:`~meridian.workers.state.replica_state.pack`) and its host copy would be paid every step."""
        return False

    @abstractmethod
    def optimizer_state(self) -> dict[str, Any]:
        """The full (unsharded) AdamW state in :mod:`meridian.workers.optim.adamw`'s layout-free form.

        Collective inside the DC for sharded engines: every rank of the DC must call it."""

    @abstractmethod
    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Take a full state written by any engine and layout; every rank passes the same whole state.
        Load the model's weights first."""

    def owned_ranges(self) -> list[tuple[str, int, int]] | None:
        """The flat element ranges ``(parameter, start, stop)`` of optimizer state this rank holds, which is all
        a resume from a sharded checkpoint reads of the moments on this rank; ``None``: everything (a
        replicated optimizer, which loads the full state)."""
        return None

    def load_local_shard(self, shard: LocalShard) -> None:
        """Take the optimizer state of exactly :meth:`owned_ranges` (their fp32 values and moments, and the
        AdamW step), as :func:`~meridian.workers.state.sharded_checkpoint.read_ranges` reads it. Load the
        model's weights first. Only engines with :meth:`owned_ranges` implement it."""
        raise TypeError(f"{type(self).__name__} holds the whole optimizer state: load it with load_optimizer_state")

    def load_weights(self, model: nn.Module, params: dict[str, torch.Tensor]) -> None:
        """Copy whole parameters (``params``: every parameter of ``model``, the unwrapped model this engine
        trains, by name) into it: what this rank holds of each. Call :meth:`synchronize` first."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name].reshape(p.shape))

    @abstractmethod
    def optimizer_state_nbytes(self) -> int:
        """Bytes of optimizer state held on this rank."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook
        """Finish communication still in flight so the parameters can be read (e.g. for a checkpoint)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
