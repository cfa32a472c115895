"""Start each bucket's sync while backward is still computing the other buckets' gradients.

On the last micro-batch of a step, a ``post_accumulate_grad_hook`` on every parameter counts the
gradients that are final in each bucket. A per-rank communication thread walks the buckets **in index
order** (so every rank issues its collectives in the same order, as the backends require; DDP does the
same) and starts each one's sync as soon as the bucket is complete: ``start_bucket`` runs what must
finish first (the intra-DC reduce-scatter) and issues the inter-DC chunks asynchronously. Buckets stay in
flight together, so on a WAN every bucket does not pay its own latency round; ``finish()`` (from the
engine's ``step``) waits for what is still outstanding, in bucket order, and runs what follows (decoding,
the intra-DC all-gather). gloo and NCCL release the GIL while a collective runs, so the thread's work
overlaps backward's compute.

Timing: ``comm_s`` is the wall time during which at least one bucket's collectives were running (the union
of [issued, completed] intervals; completion is polled every ``POLL_S`` while the thread waits for the
next bucket and a started one is still in flight), ``exposed_s`` the part ``finish()`` blocked. Buckets whose
parameters got no gradient are released when backward returns, so an unused parameter costs overlap, never a
deadlock. Without overlap the same code runs inline in ``finish()``. This module never decides what a bucket's
sync is.

On CUDA (:class:`CommStream`) a bucket's collectives are issued on a dedicated communication stream that
waits only for that bucket's gradients (an event recorded by the hook that completes the bucket), so
backward's kernels never queue behind a reduce-scatter's ``wait()``; ``finish()`` makes the training stream
wait for the communication stream before the optimizer reads the gradients. Host wall-clock is meaningless
there (NCCL's ``wait()`` returns at once), so ``comm_s`` and ``exposed_s`` come from CUDA events: per-bucket
start/end events on the communication stream, and an event on the training stream where ``finish()`` began
to wait. They are read one step late, so timing never syncs the host: on CUDA ``finish()`` returns the
previous step's figures (0 on the first step). Each step records into its own of two sets of events: with
overlap the communication thread records the next step's start events during its backward, before that
step's ``finish()`` reads the last one's, and ``elapsed_time`` refuses an event not yet complete (a set whose
events are not all complete — a host far ahead of the device — is skipped, and the figures before it kept).
On CPU nothing changes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from meridian.workers.sync.grad_buffer import Bucket, GradBuffer

POLL_S = 0.002


class Handle(Protocol):
    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


@dataclass
class InFlight:
    """One bucket's started sync: its outstanding collectives, and what to run once they are done."""

    handles: list[Handle]
    then: Callable[[], object] | None = None
    issued_at: float = field(default_factory=time.perf_counter)
    completed_at: float | None = None

    def poll(self) -> None:
        if self.completed_at is None and all(h.is_completed() for h in self.handles):
            self.completed_at = time.perf_counter()

    def finish(self) -> list[tuple[float, float]]:
        """Wait, run ``then``; return the busy intervals of this bucket."""
        for h in self.handles:
            h.wait()
        arrived = time.perf_counter()
        intervals = [(self.issued_at, self.completed_at or arrived)]
        if self.then is not None:
            self.then()
            intervals.append((arrived, time.perf_counter()))
        return intervals


def _in_flight(started: list[InFlight]) -> bool:
    return any(f.completed_at is None for f in started)


class BucketPipeline:
    """Starts ``start_bucket(bucket)`` on every bucket once per step, overlapped with backward or not."""

    def __init__(
        self, buffer: GradBuffer, start_bucket: Callable[[Bucket], InFlight], *, overlap: bool
    ) -> None:
        self.buffer = buffer
        self.start_bucket = start_bucket
        self.overlap = overlap
        self._armed = False
        self._future: Future[list[InFlight]] | None = None
        self._ready = [threading.Event() for _ in buffer.buckets]
        self._remaining = [0] * len(buffer.buckets)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._executor: ThreadPoolExecutor | None = None
        self.streams = CommStream.for_device(buffer.buckets[0].grad.device, len(buffer.buckets))
        """The CUDA communication stream and its events; ``None`` on CPU."""
        if overlap:
            device = buffer.buckets[0].grad.device
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="meridian-comm", initializer=_bind_device, initargs=(device,)
            )
            for bucket in buffer.buckets:
                for s in bucket.slots:
                    self._hooks.append(s.param.register_post_accumulate_grad_hook(self._hook(bucket.index)))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_grad_ready(_param: torch.Tensor) -> None:
            if self._armed:
                self._remaining[index] -= 1
                if self._remaining[index] == 0:
                    if self.streams is not None:
                        self.streams.bucket_ready(index)  # on backward's stream, before the comm thread sees it
                    self._ready[index].set()

        return on_grad_ready

    def arm(self) -> None:
        """Call right before the last micro-batch's backward: from here on, complete buckets are synced."""
        if self._future is not None:
            raise RuntimeError("backward(last_micro_batch=True) called twice without step()")
        if not self.overlap:
            return
        for i, bucket in enumerate(self.buffer.buckets):
            self._remaining[i] = len(bucket.slots)
            self._ready[i].clear()
        self._armed = True
        assert self._executor is not None
        self._future = self._executor.submit(self._start_all, True)

    def backward_done(self) -> None:
        """Every gradient is final now; buckets with unused parameters may go too."""
        self._armed = False
        for event in self._ready:
            event.set()

    def finish(self) -> tuple[float, float]:
        """Sync whatever is left; returns (comm_s, exposed_s) for this step."""
        t0 = time.perf_counter()
        if self.streams is not None:
            self.streams.finish_begins()
        started = self.take_started()
        if self.streams is not None:
            return self.streams.finish(started)
        return finish_all(started), time.perf_counter() - t0

    def take_started(self) -> list[InFlight]:
        """Every bucket's sync as started (with overlap by the comm thread during backward; else now), not
        waited for: :meth:`finish` waits, a sync that lands one step late does not."""
        if self._future is None:  # no overlap, or this rank had no micro-batch: start everything now
            return self._start_all(False)
        self.backward_done()
        future, self._future = self._future, None
        return future.result()

    def _start_all(self, wait_ready: bool) -> list[InFlight]:
        started: list[InFlight] = []
        for bucket in self.buffer.buckets:
            if wait_ready:
                # Waiting for backward: note when the buckets in flight complete, for comm_s. Once every one has,
                # sleep until the next bucket is ready: each poll wakes this thread and asks for the GIL.
                while not self._ready[bucket.index].wait(POLL_S if _in_flight(started) else None):
                    for flight in started:
                        flight.poll()
            t0 = time.perf_counter()
            with self.streams.issue(bucket.index) if self.streams is not None else contextlib.nullcontext():
                flight = self.start_bucket(bucket)
            flight.issued_at = t0
            started.append(flight)
        return started

    def close(self) -> None:
        self.backward_done()
        if self._future is not None:
            started = self._future.result()
            self._future = None
            for flight in started:
                flight.finish()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class _StepEvents:
    """One step's timing events: per bucket, start and end on the communication stream; where ``finish()`` began
    to wait, on the training stream."""

    def __init__(self, buckets: int) -> None:
        self.start = [torch.cuda.Event(enable_timing=True) for _ in range(buckets)]
        self.end = [torch.cuda.Event(enable_timing=True) for _ in range(buckets)]
        self.waits = torch.cuda.Event(enable_timing=True)
        self.n = 0
        """Buckets recorded and not yet read (0: nothing to read)."""

    def complete(self) -> bool:
        return all(e.query() for e in (*self.start[: self.n], *self.end[: self.n], self.waits))

    def read(self) -> tuple[float, float]:
        """(comm_s, exposed_s) of the step these events timed."""
        n, origin = self.n, self.start[0]
        busy = [(origin.elapsed_time(self.start[i]) / 1e3, origin.elapsed_time(self.end[i]) / 1e3) for i in range(n)]
        exposed = max(0.0, self.waits.elapsed_time(self.end[n - 1]) / 1e3)
        return _union(busy), exposed


class CommStream:
    """The CUDA side of a :class:`BucketPipeline`: a dedicated stream for the collectives, events that order
    it after each bucket's gradients, and event-based timings read one step late (module docstring)."""

    def __init__(self, device: Any, buckets: int) -> None:
        self.device = device
        self.training = torch.cuda.current_stream(device)
        """The training thread's stream (built there): backward's kernels and the optimizer's."""
        self.stream = torch.cuda.Stream(device=device)
        self._ready = [torch.cuda.Event() for _ in range(buckets)]
        self._armed = [False] * buckets
        self._steps = (_StepEvents(buckets), _StepEvents(buckets))
        self._current = 0
        """The set this step records into; the other holds the last step's, until ``finish_begins`` reads it."""
        self._previous: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def for_device(cls, device: Any, buckets: int) -> CommStream | None:
        """A communication stream for a CUDA device; ``None`` (host timing, no streams) elsewhere."""
        return cls(device, buckets) if torch.device(device).type == "cuda" and buckets else None

    def bucket_ready(self, index: int) -> None:
        self._ready[index].record()  # the current stream: the one backward produced the gradients on
        self._armed[index] = True

    @contextlib.contextmanager
    def issue(self, index: int) -> Any:
        """Issue bucket ``index``'s collectives on the communication stream, after its gradients."""
        with torch.cuda.stream(self.stream):
            if self._armed[index]:
                self.stream.wait_event(self._ready[index])
                self._armed[index] = False
            else:  # inline (no overlap), or a bucket without gradients: after all the training stream queued
                self.stream.wait_stream(self.training)
            self._steps[self._current].start[index].record(self.stream)
            yield

    def finish_begins(self) -> None:
        last = self._steps[1 - self._current]
        if last.n and last.complete():  # the last step's events (this step's are still being recorded)
            self._previous = last.read()
        last.n = 0
        self._steps[self._current].waits.record(self.training)

    def finish(self, started: list[InFlight]) -> tuple[float, float]:
        """Wait for ``started`` on the communication stream, order the training stream after it; returns
        the previous step's (comm_s, exposed_s)."""
        events = self._steps[self._current]
        with torch.cuda.stream(self.stream):
            for i, flight in enumerate(started):
                flight.finish()  # NCCL's wait(): the communication stream waits, the host does not
                events.end[i].record(self.stream)
        self.training.wait_stream(self.stream)  # the optimizer reads the synced gradients after it
        events.n = len(started)
        self._current = 1 - self._current  # the next step records into the other set
        return self._previous


def finish_all(flights: list[InFlight]) -> float:
    """Finish ``flights`` in bucket order (every rank the same); return how long at least one was busy."""
    return _union([interval for flight in flights for interval in flight.finish()])


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _bind_device(device: torch.device) -> None:
    # A CUDA collective issued from this thread must run on the training process's GPU.
    if device.type == "cuda":
        torch.cuda.set_device(device)
