"""The comm thread of the overlapped sync: it notes when each bucket's collectives complete (for ``comm_s``)
by polling while any is in flight, and sleeps once none is (every poll wakes it and asks for the GIL)."""

from __future__ import annotations

import threading
import time

from torch import nn

from meridian.workers.sync.grad_buffer import GradBuffer
from meridian.workers.sync.overlap import BucketPipeline, InFlight


class _Handle:
    def __init__(self) -> None:
        self.done = threading.Event()

    def wait(self) -> None:
        self.done.wait()

    def is_completed(self) -> bool:
        return self.done.is_set()


class _Counted(InFlight):
    polls = 0

    def poll(self) -> None:
        _Counted.polls += 1
        super().poll()


def test_the_comm_thread_polls_only_while_a_bucket_s_sync_is_in_flight():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    buffer = GradBuffer(model, bucket_mb=0.01, pad_to=1)  # each weight its own bucket
    assert len(buffer.buckets) >= 2
    handles = [_Handle() for _ in buffer.buckets]
    flights: list[_Counted] = []

    def start(bucket) -> _Counted:
        flights.append(_Counted([handles[bucket.index]]))
        return flights[-1]

    pipe = BucketPipeline(buffer, start, overlap=True)
    try:
        pipe._ready[0].set()  # the first bucket is ready, the next not yet: the thread waits for it
        worker = threading.Thread(target=pipe._start_all, args=(True,))
        worker.start()
        time.sleep(0.1)  # the first bucket's sync in flight: polled every POLL_S (2 ms)
        assert _Counted.polls >= 5, _Counted.polls
        handles[0].done.set()  # it completes: a poll notes when, then none until the next bucket is ready
        deadline = time.monotonic() + 10
        while flights[0].completed_at is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert flights[0].completed_at is not None
        noted = _Counted.polls
        time.sleep(0.1)
        assert _Counted.polls == noted, (noted, _Counted.polls)
        for h in handles:
            h.done.set()
        for event in pipe._ready:
            event.set()
        worker.join(timeout=5)
        assert not worker.is_alive()
    finally:
        pipe.close()
