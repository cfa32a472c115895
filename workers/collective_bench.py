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
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

AllReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class PerfRow:
    size_bytes: int
    count: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def message_sizes(min_bytes: int = 8, max_bytes: int = 64 * 2**20, factor: int = 4) -> list[int]:
    if not 4 <= min_bytes <= max_bytes:
        raise ValueError(f"need 4 <= min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    if factor < 2:
        raise ValueError(f"factor must be >= 2, got {factor}")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def iterations_for(size_bytes: int, budget_bytes: int = 256 * 2**20, lo: int = 3, hi: int = 50) -> int:
    """Many calls for small messages (latency is noisy), few for huge ones (keep the run short)."""
    return max(lo, min(hi, budget_bytes // max(size_bytes, 1)))


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


@dataclass(frozen=True)
class LinkFigures:
    """A link tier summarised as the two numbers a cost model needs."""

    latency_s: float
    """Per-message latency of the tier: the smallest all-reduce's time divided by the 2(n-1) steps in which
    a ring all-reduce over n ranks sends its messages one after another (what the cost model charges per
    round)."""
    bandwidth_gbps: float
    """Bus bandwidth at the largest message (what one link carries when saturated)."""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    def to_dict(self) -> dict[str, float]:
        return {"latency_us": self.latency_s * 1e6, "bandwidth_gbps": self.bandwidth_gbps}


def summarise(rows: list[PerfRow]) -> LinkFigures:
    if not rows:
        raise ValueError("no benchmark rows to summarise")
    smallest = min(rows, key=lambda r: r.size_bytes)
    largest = max(rows, key=lambda r: r.size_bytes)
    rounds = max(1, 2 * (ring_ranks(smallest) - 1))
    return LinkFigures(latency_s=smallest.time_us / 1e6 / rounds, bandwidth_gbps=largest.busbw_gbps)


def ring_ranks(row: PerfRow) -> int:
    """The ranks a row was measured over, from its bus/algorithm bandwidth ratio, 2(n-1)/n by definition."""
    if row.algbw_gbps <= 0:
        return 1
    return max(1, round(2 / (2 - min(row.busbw_gbps / row.algbw_gbps, 1.999))))
