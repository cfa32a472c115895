"""What a collective benchmark measured, and a link tier summarised from it; torch-free.

The rows cross from the probe actors (:mod:`meridian.workers.probes.collective_bench`) to the control plane's
planner, which must not load torch to read them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
