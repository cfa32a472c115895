"""Each step's global loss, inter-DC bytes and leave flag, summed over every rank a window of steps at a time.

Rank 0 reports every step's loss summed over the ranks that compute it, and every rank must agree on the step at
which the epoch's ranks leave to re-form (:mod:`meridian.workers.loop.train`). Both need a sum over all ranks,
across datacenters. A *window*'s sum is issued asynchronously once its last step is done, and read once the next
window's last step is done, so the next window's steps hide its latency.

On a LAN one step hides it. But a sum costs the loop its issue and read (~0.1 ms on CPU), and each read ties the
ranks' loops together (a rank a little ahead waits there for the slowest), so once the step's time is known a
window spans at least ``min_window_s`` (50 ms: 6 steps of 8 ms). Over a far link the sum takes longer than a
step; read every step it would pace the loop at one round trip per step even when the gradient sync waits for
nothing (DiLoCo). So each window also carries how long every rank waited at the read before it and how long
that sum took from issue to read. Every rank reads the same sums (an all-reduce hands every rank the same
result), so every rank widens the window at the same step: to twice the steps the measured latency spans, up to
``max_window_s`` of steps (the leave flag is read at most two windows late).

A DiLoCo job's weights cross the datacenters once per outer cycle; its sums need not cross more often. Its
windows span at least ``min_window_steps``, the outer cycle's inner steps, past ``max_window_s``, once the step's
time is known: a sum every step would cost the far link a round of small packets (headers and ACKs many times a
sync's sparse payload) and tie the datacenters' loops together at every step, which the outer cycle exists to
avoid. A leave is then read at most two outer cycles late. Up to ``max_cycle_window_s`` of steps: the service
still hears of the loss every half minute when a cycle is long (500 steps of a second).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from meridian.workers.loop.step import StepOutput
from meridian.workers.state.snapshots import snapshot_interval
from meridian.workers.sync.engine import StepStats

__all__ = ["ReportWindows", "StepReport"]

_CALIBRATION = 6
"""Per window, after its steps' losses and bytes and the leave flag: this rank's wait for the window before,
that window's latency from issue to read, this window's busy seconds (its steps' time, less waits), and of its
state snapshots: what one holds the loop up, what its background write takes, and the window's seconds spent
taking them (:meth:`ReportWindows.add`)."""


@dataclass
class StepReport:
    """One step, as rank 0 reports it once its window's sum is read."""

    step: int
    out: StepOutput
    done_at: float
    loss: float = math.nan
    """The step's loss summed over the ranks (each rank contributes its share of the global mean)."""
    inter_dc_bytes: int = 0
    """Bytes all ranks put into inter-DC collectives in the step."""
    stats: StepStats | None = None
    """The engine's stats, with the grad norm as a float."""
    val_loss: float | None = None
    """The validation loss measured after this step, when the job asks for one."""


@dataclass
class _Window:
    rows: list[StepReport] = field(default_factory=list)
    contribs: list[torch.Tensor] = field(default_factory=list)
    flag: float = 0.0
    busy_s: float = 0.0
    snapshot_cost: tuple[float, float] = (0.0, 0.0)
    snapshot_s: float = 0.0


@dataclass
class _InFlight:
    rows: list[StepReport]
    totals: torch.Tensor
    """The sums, readable once :meth:`wait` returns (on CUDA: a pinned host copy, then the grad norms)."""
    work: dist.Work
    issued_at: float
    ready: Any = None
    """On CUDA: an event after which ``totals`` is readable; waiting for it does not wait for the steps queued
    since (``.item()`` on the device would)."""
    device_totals: torch.Tensor | None = None

    def wait(self) -> None:
        if self.ready is None:
            self.work.wait()
        else:
            self.ready.synchronize()


_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """The stream that copies each window's sums to the host (CUDA)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


class ReportWindows:
    """The loop's per-step sums over the default process group (every rank of the epoch must make the same
    calls): :meth:`add` after each step, :meth:`flush` before leaving the epoch or after its last step."""

    def __init__(self, device: torch.device, world_size: int, *, max_window_s: float = 2.0,
                 min_window_s: float = 0.05, grow_above: float = 0.05, first_window: int = 1,
                 min_window_steps: int = 1, max_cycle_window_s: float = 30.0, snapshot_every: int = 1,
                 adaptive_snapshots: bool = False) -> None:  # fmt: skip
        if min_window_steps < 1:
            raise ValueError(f"min_window_steps must be >= 1, not {min_window_steps}")
        self.device = device
        self.world_size = world_size
        self.max_window_s = max_window_s
        self.min_window_s = min_window_s
        """A window spans at least this long once the step's time is known: each sum's own cost (issuing and
        reading it) and the rank pacing (every rank waits at a read for the slowest one's window) come once per
        window, not once per short step."""
        self.grow_above = grow_above
        """Widen the window when ranks waited, on average, more than this share of a window's busy time."""
        self.min_window_steps = min_window_steps
        """Steps a window spans at least once the step's time is known, past ``max_window_s`` and up to
        ``max_cycle_window_s``: a DiLoCo job's outer cycle."""
        self.max_cycle_window_s = max_cycle_window_s
        self.window = first_window
        """Steps per window, the same on every rank."""
        self.leave = False
        """Some rank asked to leave: every rank reads the same sum, so all see it after the same step."""
        self.snapshot_every = snapshot_every
        """Steps between state snapshots, the same on every rank: with ``adaptive_snapshots`` it widens (never
        narrows) at a window's read to what :func:`snapshot_interval` asks of the ranks' mean snapshot costs."""
        self.adaptive_snapshots = adaptive_snapshots
        self.snapshots_widened: tuple[int, float, float, float] | None = None
        """Set when the last read widened the cadence: (every, loop_s, background_s, step_s); the loop clears it."""
        self._open = _Window()
        self._in_flight: _InFlight | None = None
        self._last_wait_s = 0.0
        self._last_latency_s = 0.0
        self._mark = time.perf_counter()

    def add(self, step: int, out: StepOutput, contrib: torch.Tensor, *, leave: bool,
            snapshot: tuple[tuple[float, float], float] | None = None) -> list[StepReport]:  # fmt: skip
        """A finished step: ``contrib`` is this rank's share of its loss (0-d, on the device) and ``leave``
        whether this rank asks to leave; ``snapshot``, when the step took one: this rank's snapshot cost
        (seconds it holds the loop up, seconds its background write takes) and the seconds this step spent
        taking it. Returns the steps whose sums were read now, in order."""
        now = time.perf_counter()
        w = self._open
        w.busy_s += now - self._mark
        if snapshot is not None:
            w.snapshot_cost = snapshot[0]
            w.snapshot_s += snapshot[1]
        w.rows.append(StepReport(step=step, out=out, done_at=time.time()))
        w.contribs.append(contrib.detach().float().reshape(1))
        w.flag = max(w.flag, 1.0 if leave else 0.0)
        read: list[StepReport] = []
        if len(w.rows) >= self.window:
            read = self._close()
        self._mark = time.perf_counter()
        return read

    def set_val_loss(self, val_loss: float) -> None:
        """The validation loss measured after the step added last."""
        rows = self._open.rows or (self._in_flight.rows if self._in_flight else [])
        assert rows, "no step to attach a validation loss to"
        rows[-1].val_loss = val_loss

    def flush(self) -> list[StepReport]:
        """Issue the open window, however short (every rank's is as long), and read every sum in flight."""
        read = self._close() if self._open.rows else []
        if self._in_flight is not None:
            read += self._read(self._in_flight)
            self._in_flight = None
        return read

    def _close(self) -> list[StepReport]:
        """Read the window before (its latency hidden by this one's steps), then issue this one's sum, carrying what
        that read measured: every rank learns of a slow sum one window after it, not two."""
        w, self._open = self._open, _Window()
        read = self._read(self._in_flight) if self._in_flight is not None else []
        self._in_flight = self._issue(w)
        return read

    def _issue(self, w: _Window) -> _InFlight:
        n, dev = len(w.rows), self.device
        host = [float(r.out.inter_dc_bytes) for r in w.rows]
        host += [w.flag, self._last_wait_s, self._last_latency_s, w.busy_s, *w.snapshot_cost, w.snapshot_s]
        # On this rank's device (NCCL on a GPU): no host sync here, the sum is read a window later.
        totals = torch.cat([torch.cat(w.contribs).to(dev), torch.tensor(host).to(dev, non_blocking=True)])
        work = dist.all_reduce(totals, async_op=True)
        issued_at = time.perf_counter()
        if not totals.is_cuda:  # gloo: the host waits in _read
            return _InFlight(w.rows, totals, work, issued_at)
        # NCCL: a side stream waits for the sum and the steps, then copies it and the grad norms to pinned
        # memory; neither the host nor the training stream waits here.
        side = _side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        pinned = torch.empty(totals.numel() + n, pin_memory=True)
        with torch.cuda.stream(side):
            work.wait()
            pinned[: totals.numel()].copy_(totals, non_blocking=True)
            norms = torch.stack([torch.as_tensor(r.out.stats.grad_norm, device=dev).float() for r in w.rows])
            pinned[totals.numel():].copy_(norms, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        return _InFlight(w.rows, pinned, work, issued_at, ready, totals)

    def _read(self, f: _InFlight) -> list[StepReport]:
        began = time.perf_counter()
        f.wait()
        done = time.perf_counter()
        self._last_wait_s, self._last_latency_s = done - began, done - f.issued_at
        n = len(f.rows)
        t = f.totals.tolist()
        for i, row in enumerate(f.rows):
            row.loss, row.inter_dc_bytes = t[i], int(t[n + i])
            norm = t[2 * n + 1 + _CALIBRATION + i] if f.ready is not None else float(row.out.stats.grad_norm)
            row.stats = replace(row.out.stats, grad_norm=norm)
        self.leave = self.leave or t[2 * n] > 0
        wait_s, latency_s, busy_s, loop_s, background_s, snapshot_s = (
            x / self.world_size for x in t[2 * n + 1: 2 * n + 1 + _CALIBRATION])
        self._widen(wait_s, latency_s, busy_s / n)
        if self.adaptive_snapshots and (loop_s or background_s):
            step_s = max(0.0, busy_s - snapshot_s) / n
            every = snapshot_interval(loop_s, background_s, step_s)
            if every > self.snapshot_every:
                self.snapshot_every = every
                self.snapshots_widened = (every, loop_s, background_s, step_s)
        return f.rows

    def _widen(self, wait_s: float, latency_s: float, step_s: float) -> None:
        """From the mean figures every rank read alike: a window of at least ``min_window_s``, and when the loop
        waited for its sums, one that spans twice the sums' latency; never narrower (a window only grows within
        an epoch) nor past ``max_window_s``, unless ``min_window_steps`` asks for more (up to
        ``max_cycle_window_s``)."""
        if step_s <= 0:
            return
        wanted = math.ceil(self.min_window_s / step_s)
        if wait_s > self.grow_above * step_s * self.window:
            wanted = max(wanted, math.ceil(2 * latency_s / step_s))
        cap = max(1, int(self.max_window_s / step_s))
        cycle = min(self.min_window_steps, max(1, int(self.max_cycle_window_s / step_s)))
        self.window = max(self.window, min(cap, wanted), cycle)
