"""Pipeline parallelism: micro-batches through the stages of one replica, GPipe or 1F1B, over send/recv.

One optimizer step on stage ``s`` of ``pp`` with ``m`` micro-batches::

    gpipe: F0 F1 … F(m-1)  B0 B1 … B(m-1)
    1f1b:  F0 … F(w-1)  then F(w) B0, F(w+1) B1, …  then the remaining B      (w = min(pp - s - 1, m))

F(i): receive micro-batch i's hidden states from stage s-1 (the first stage embeds tokens), run this
stage, send the output to stage s+1 (the last stage computes the loss). B(i): receive the gradient of that
output from stage s+1, backward, send the input's gradient to stage s-1. Both schedules have the same
bubble, (pp - 1) / (m + pp - 1) of the step; 1F1B keeps at most pp - s micro-batches of activations instead
of m (Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters", §2.2).
Backwards run in micro-batch order in both schedules, so B(m-1) is the last one and the sync engine's
``last_micro_batch`` (which starts the data-parallel gradient sync) means the same everywhere.

Messages go out as one ``batch_isend_irecv`` per pipeline tick: a send is queued and issued together with
the stage's next receive (or at the end of the step), and only the receives are waited for. Before a stage
blocks, every send it has produced is therefore in flight, so no stage can wait on a peer that waits on it;
on NCCL the tick's sends and receives form one group, as NCCL requires of paired point-to-point calls in
both directions (unbatched ``isend`` and blocking ``recv`` can deadlock there). Each device type gets its own
batch (the WAN emulator's arrival times are CPU tensors, for gloo, beside CUDA activations for NCCL). Why hand-written rather than ``torch.distributed.pipelining``:
its schedules own the backward call, and the hierarchical sync needs to wrap the last micro-batch's
backward (:meth:`GradientSync.backward`) to overlap the inter-DC sync with it. Across datacenters each
message goes through the WAN emulator (arrival time booked on the shared link, sent ahead of the data).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meridian.workers.contracts.config import PipelineSchedule
from meridian.workers.model.gpt import per_sample_loss
from meridian.workers.sync.engine import GradientSync
from meridian.workers.wan.emulator import WanEmulator, p2p_cost, sleep_until


@dataclass
class _InFlight:
    inp: torch.Tensor
    out: torch.Tensor  # hidden states (or this micro-batch's loss share on the last stage)


class StageRunner:
    """Runs this rank's pipeline stage for one step at a time."""

    def __init__(
        self,
        stage: nn.Module,
        *,
        prev: int | None,
        next: int | None,  # noqa: A002 - the stage after this one
        schedule: PipelineSchedule,
        pp: int,
        stage_index: int,
        d_model: int,
        autocast: Callable[[], AbstractContextManager[object]],
        emulator: WanEmulator | None = None,
    ) -> None:
        self.stage = stage
        self.prev, self.next = prev, next
        self.schedule = schedule
        self.pp, self.stage_index = pp, stage_index
        self.d_model = d_model
        self.autocast = autocast
        self.emulator = emulator if emulator is not None and emulator.enabled else None
        self._sends: list[tuple[dist.Work, object]] = []  # with the tensors they send, kept alive
        self._queued: list[dist.P2POp] = []
        """Sends produced since the last tick, issued with its next receives (:meth:`_exchange`)."""

    # -- point to point, through the WAN emulator across datacenters ----------------------------------------------

    def _crosses(self, peer: int) -> bool:
        emu = self.emulator
        return emu is not None and emu.layout.dc_of(peer) != emu.layout.dc_of(emu.rank)

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        if self._crosses(dst):
            emu = self.emulator
            assert emu is not None
            nbytes = tensor.numel() * tensor.element_size()
            cost = p2p_cost(emu.rank, dst, emu.layout, nbytes)
            emu.counter.add(nbytes, cost.bytes_of(emu.rank))
            arrival = torch.tensor([emu.book(cost, time.monotonic())], dtype=torch.float64)
            self._queued.append(dist.P2POp(dist.isend, arrival, dst))
        self._queued.append(dist.P2POp(dist.isend, tensor, dst))

    def _recv(self, shape: tuple[int, ...], src: int, device: torch.device) -> torch.Tensor:
        arrival = None
        recvs = []
        if self._crosses(src):
            arrival = torch.empty(1, dtype=torch.float64)
            recvs.append(dist.P2POp(dist.irecv, arrival, src))
        buf = torch.empty(shape, dtype=torch.float32, device=device)
        recvs.append(dist.P2POp(dist.irecv, buf, src))
        self._exchange(recvs)
        if arrival is not None:
            sleep_until(float(arrival.item()))
        return buf

    def _exchange(self, recvs: list[dist.P2POp]) -> None:
        """One tick: the queued sends and ``recvs`` as one ``batch_isend_irecv`` per device type; returns
        when the receives are done (the sends complete by the end of the step)."""
        ops, self._queued = self._queued + recvs, []
        by_type: dict[str, list[dist.P2POp]] = {}
        for op in ops:
            by_type.setdefault(op.tensor.device.type, []).append(op)
        for batch in by_type.values():
            works = dist.batch_isend_irecv(batch)
            if len(works) == len(batch):  # one work per operation (gloo): wait for the receives only
                pairs = list(zip(batch, works, strict=True))
                waits = [w for op, w in pairs if op.op is dist.irecv]
                self._sends += [(w, op.tensor) for op, w in pairs if op.op is not dist.irecv]
            elif any(op.op is dist.irecv for op in batch):  # one work for the coalesced group (NCCL)
                waits = works
            else:
                waits = []
                self._sends += [(w, [op.tensor for op in batch]) for w in works]
            for w in waits:
                w.wait()

    def _flush(self) -> None:
        self._exchange([])
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    # -- one step -------------------------------------------------------------------------------------------------

    def _forward(self, x: torch.Tensor, y: torch.Tensor, global_batch: int, device: torch.device) -> _InFlight:
        b, t = x.shape
        if self.prev is None:
            inp = x.to(device)
        else:
            inp = self._recv((b, t, self.d_model), self.prev, device).requires_grad_()
        with self.autocast():
            out = self.stage(inp)
            if self.next is None:  # this micro-batch's share of the global-batch mean loss
                out = per_sample_loss(out, y.to(device)).sum() / global_batch
        if self.next is not None:
            self._send(out.float(), self.next)
        return _InFlight(inp, out)

    def _backward(self, f: _InFlight, engine: GradientSync, last: bool) -> None:
        if self.next is None:
            engine.backward(f.out, last_micro_batch=last)
        else:
            grad = self._recv(tuple(f.out.shape), self.next, f.out.device)
            # d(sum(out · grad))/dθ is the vector-Jacobian product out.backward(grad), through the engine.
            engine.backward((f.out.float() * grad).sum(), last_micro_batch=last)
        if self.prev is not None:
            assert f.inp.grad is not None
            self._send(f.inp.grad, self.prev)

    def train_step(
        self, engine: GradientSync, batches: list[tuple[torch.Tensor, torch.Tensor]], global_batch: int,
        device: torch.device,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns this stage's loss share (0 off the last stage)."""
        m = len(batches)
        warmup = m if self.schedule is PipelineSchedule.GPIPE else min(self.pp - self.stage_index - 1, m)
        pending: list[_InFlight] = []
        loss = torch.zeros((), device=device)
        done_f = done_b = 0

        def forward() -> None:
            nonlocal done_f, loss
            x, y = batches[done_f]
            f = self._forward(x, y, global_batch, device)
            if self.next is None:
                loss = loss + f.out.detach()
            pending.append(f)
            done_f += 1

        def backward() -> None:
            nonlocal done_b
            self._backward(pending.pop(0), engine, last=done_b == m - 1)
            done_b += 1

        for _ in range(warmup):
            forward()
        while done_f < m:  # steady state: one forward, one backward
            forward()
            backward()
        while done_b < m:
            backward()
        self._flush()
        return loss

    @torch.no_grad()
    def forward_only(self, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Mean loss of one batch on the last stage (0 elsewhere): evaluation."""
        b, t = x.shape
        inp = x.to(device) if self.prev is None else self._recv((b, t, self.d_model), self.prev, device)
        with self.autocast():
            out = self.stage(inp)
        if self.next is not None:
            self._send(out.float(), self.next)
            self._flush()
            return torch.zeros((), device=device)
        return per_sample_loss(out, y.to(device)).mean()
