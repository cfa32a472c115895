"""What a rank measures about itself for the metrics views: device peak FLOP/s and per-step heartbeats.

Runs inside training processes with or without Ray; never imports Ray, ``meridian.api`` or
``meridian.service``. A sink that wants per-rank heartbeats (the Ray entry point's) has a ``rank_step``
method; sinks without one (tests' :class:`~meridian.workers.loop.records.ListSink`) cost nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from meridian.workers.contracts.records import DevicePeak

PEAK_MATMUL_N = {"cuda": 8192, "cpu": 256}
"""Side of the square matmuls that measure a device's peak: 256 is as fast as a CPU gets; a GPU needs products
big enough to fill every multiprocessor (at 256 an H100 reaches a few per cent of its rate)."""


def measure_peak_flops(device: torch.device, *, n: int | None = None, bursts: int = 8, burst_s: float = 0.04) -> DevicePeak:
    """The best rate of square matmuls, in the dtype training would use on this device, over short bursts.

    Vendors publish GPU peaks but no table of them is kept here (it would go stale and invent numbers for
    unknown parts), and a CPU has no published figure at all: the measured matmul rate is the honest
    ceiling of what the training kernels could reach on this device, threads as configured. The best
    burst, not the mean, because other processes sharing the cores only ever make a burst slower.
    """
    n = n or PEAK_MATMUL_N.get(device.type, PEAK_MATMUL_N["cpu"])
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    dtype = torch.bfloat16 if native_bf16 else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: first call pays for kernel selection
    best = 0.0
    for _ in range(bursts):
        iters, t0 = 0, time.perf_counter()
        while True:
            a @ b
            iters += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= burst_s and iters >= 2:
                break
        best = max(best, 2 * n**3 * iters / elapsed)
    return DevicePeak(flops=best, source=f"measured {n}x{n} {str(dtype).removeprefix('torch.')} matmul on {device.type} "
                      f"(best of {bursts} bursts)")


def mfu(flops_per_token: int, tokens_per_s: float, world: int, peak: DevicePeak | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all ``world`` devices."""
    if peak is None or peak.flops <= 0 or world <= 0:
        return None
    return flops_per_token * tokens_per_s / (world * peak.flops)


@dataclass(frozen=True)
class StepTimes:
    """One rank's split of one step: waiting for data, computing, waiting for communication."""

    step_s: float
    data_s: float
    sync_wait_s: float

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.data_s - self.sync_wait_s)


def heartbeat(rank: int, step: int, times: StepTimes) -> dict[str, Any]:
    """What every rank tells the service after finishing step ``step`` (1-based steps done)."""
    return {"rank": rank, "phase": "done", "step": step, "step_s": times.step_s, "data_s": times.data_s,
            "compute_s": times.compute_s, "sync_wait_s": times.sync_wait_s, "time": time.time()}


def computed_beat(rank: int, step: int) -> dict[str, Any]:
    """Sent when forward + backward of step ``step`` (1-based) is done, before the optimizer step waits for
    the gradient sync: a rank blocked on its peers has said so, a rank that stalled has not."""
    return {"rank": rank, "phase": "computed", "step": step, "time": time.time()}
