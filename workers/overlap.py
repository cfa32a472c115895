"""Start each bucket's sync while backward is still computing the other buckets' gradients.

On the last micro-batch of a step, a ``post_accumulate_grad_hook`` on every parameter counts the
gradients that are final in each bucket. A per-rank communication thread walks the buckets **in index
order** (so every rank issues its collectives in the same order, as the backends require; DDP does the
same) and runs ``sync_bucket`` on each one as soon as it is complete. gloo and NCCL release the GIL while
a collective runs, so the thread's waits overlap backward's compute. ``finish()`` (from the engine's
``step``) waits only for what is still outstanding and reports how much of the communication was hidden.

Buckets whose parameters got no gradient are released when backward returns, so an unused parameter
costs overlap, never a deadlock. Without overlap the same ``sync_bucket`` runs inline in ``finish()``.
This module never decides what a bucket's sync is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from meridian.workers.grad_buffer import Bucket, GradBuffer


class BucketPipeline:
    """Runs ``sync_bucket(bucket)`` on every bucket once per step, overlapped with backward or not."""

    def __init__(self, buffer: GradBuffer, sync_bucket: Callable[[Bucket], None], *, overlap: bool) -> None:
        self.buffer = buffer
        self.sync_bucket = sync_bucket
        self.overlap = overlap
        self._armed = False
        self._future: Future[float] | None = None
        self._ready = [threading.Event() for _ in buffer.buckets]
        self._remaining = [0] * len(buffer.buckets)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._executor: ThreadPoolExecutor | None = None
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
        self._future = self._executor.submit(self._run, True)

    def backward_done(self) -> None:
        """Every gradient is final now; buckets with unused parameters may go too."""
        self._armed = False
        for event in self._ready:
            event.set()

    def finish(self) -> tuple[float, float]:
        """Sync whatever is left; returns (comm_s, exposed_s) for this step.

        ``comm_s``: seconds spent in the buckets' collectives (on the comm thread when overlapped).
        ``exposed_s``: seconds the caller was blocked here waiting for them.
        """
        t0 = time.perf_counter()
        if self._future is None:  # no overlap, or this rank had no micro-batch: sync inline
            comm_s = self._run(False)
        else:
            self.backward_done()
            future, self._future = self._future, None
            comm_s = future.result()
        return comm_s, time.perf_counter() - t0

    def _run(self, wait_ready: bool) -> float:
        comm_s = 0.0
        for bucket in self.buffer.buckets:
            if wait_ready:
                self._ready[bucket.index].wait()
            t0 = time.perf_counter()
            self.sync_bucket(bucket)
            comm_s += time.perf_counter() - t0
        return comm_s

    def close(self) -> None:
        self.backward_done()
        if self._future is not None:
            self._future.result()
            self._future = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _bind_device(device: torch.device) -> None:
    # A CUDA collective issued from this thread must run on the training process's GPU.
    if device.type == "cuda":
        torch.cuda.set_device(device)
