"""A collective benchmark in the spirit of nccl-tests' ``all_reduce_perf``, for any process group.

For each message size: a few warm-up calls, then ``iters`` timed all-reduces; the time reported is the
slowest rank's mean (a collective is as fast as its slowest member). As in nccl-tests::

    algbw = size / time                       what one rank's buffer moved per second
    busbw = algbw * 2 (n - 1) / n             what each link carried (ring all-reduce), comparable across n

Runs wherever a process group exists: inside Ray probe actors (one per node of a link tier), in tests, in
the bench CLI. Must not import the service or the API.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meridian.workers.contracts.link_perf import PerfRow, iterations_for

AllReduce = Callable[[torch.Tensor], None]


def all_reduce_perf(
    sizes: list[int], *, group: dist.ProcessGroup | None = None, all_reduce: AllReduce | None = None,
    dtype: torch.dtype = torch.float32, warmup: int = 2, device: torch.device | None = None,
) -> list[PerfRow]:
    """Benchmark all-reduce over ``group`` (default: world) for each size in bytes.

    ``all_reduce`` replaces ``dist.all_reduce(t, group=group)`` — e.g. the WAN emulator's version, so the
    emulated inter-DC link can be measured back.
    """
    device = device or torch.device("cpu")
    n = dist.get_world_size(group)
    op = all_reduce or (lambda t: dist.all_reduce(t, group=group))
    elem = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for size in sizes:
        count = max(1, size // elem)
        buf = torch.ones(count, dtype=dtype, device=device)
        iters = iterations_for(size)
        for _ in range(warmup):
            op(buf)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            op(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mean = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=group)
        seconds = mean.item()
        nbytes = count * elem
        algbw = nbytes / seconds / 1e9 * 8  # Gbit/s
        rows.append(PerfRow(nbytes, count, seconds * 1e6, algbw, algbw * 2 * (n - 1) / n))
    return rows
