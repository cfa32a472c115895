"""The CUDA side of the bucket pipeline, on CPU with fake CUDA events and streams: the timing events of one
step are never read while the next step records into them, nor before they complete (``elapsed_time`` refuses
an incomplete event: ``TORCH_CHECK(query() && other.query())`` in c10/cuda/CUDAEvent.h)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import meridian.workers.sync.overlap as overlap
from meridian.workers.sync.grad_buffer import GradBuffer


class Clock:
    step = 0
    done_through = -1  # events recorded in steps up to this one have completed on the "device"


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.step: int | None = None

    def record(self, stream=None) -> None:
        self.step = Clock.step

    def query(self) -> bool:
        return self.step is not None and self.step <= Clock.done_through

    def elapsed_time(self, other: FakeEvent) -> float:
        if not (self.query() and other.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return 1.0


class FakeStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def _fake_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(overlap, "_bind_device", lambda device: None)
    monkeypatch.setattr(overlap.CommStream, "for_device", classmethod(lambda cls, device, n: cls(device, n)))


def _train(pipe, model, steps, lag):
    """``steps`` overlapped steps; the device completes each step's work ``lag`` steps after the host issued it."""
    out = []
    for step in range(steps):
        Clock.step, Clock.done_through = step, step - lag
        pipe.arm()
        model(torch.randn(4, 8)).sum().backward()
        pipe.backward_done()
        out.append(pipe.finish())
    return out


def test_overlapped_steps_read_the_last_step_s_complete_events_and_never_the_current_ones(monkeypatch):
    _fake_cuda(monkeypatch)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    buffer = GradBuffer(model, bucket_mb=1e-4, pad_to=1)
    assert len(buffer.buckets) > 1
    pipe = overlap.BucketPipeline(buffer, lambda bucket: overlap.InFlight([]), overlap=True)
    try:
        # Before: step 1 read the start events the communication thread had just recorded for step 1 (RuntimeError).
        figures = _train(pipe, model, steps=4, lag=1)
        assert figures[0] == (0.0, 0.0) and all(f != (0.0, 0.0) for f in figures[1:])
        # A host further ahead than the device: incomplete events are not read, the last figures are kept.
        Clock.step = Clock.done_through = 0
        lagging = _train(pipe, model, steps=3, lag=3)
        assert lagging == [figures[-1]] * 3
    finally:
        pipe.close()
