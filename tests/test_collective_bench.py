"""The collective benchmark behind link figures: nccl-tests' algbw/busbw, and per-round latency."""

from __future__ import annotations

import pytest

from meridian.workers.contracts.link_perf import PerfRow, message_sizes, ring_ranks, summarise
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.probes.collective_bench import all_reduce_perf


def _perf(rank, world):
    return all_reduce_perf(message_sizes(8, 2**16, factor=16), warmup=1)


def test_all_reduce_perf_rows_and_their_summary_on_three_ranks():
    rows = run_processes(_perf, 3, timeout_s=120)[0]
    assert [r.size_bytes for r in rows] == [8, 128, 2048, 32768]
    for r in rows:
        assert r.time_us > 0 and r.busbw_gbps == pytest.approx(r.algbw_gbps * 2 * 2 / 3)  # 2(n-1)/n
        assert ring_ranks(r) == 3
    link = summarise(rows)
    # A ring all-reduce over 3 ranks sends in 4 steps one after another: the latency charged per round.
    assert link.latency_s == pytest.approx(rows[0].time_us / 1e6 / 4)
    assert link.bandwidth_gbps == rows[-1].busbw_gbps


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64])
def test_ring_ranks_reads_the_rank_count_back_from_the_bandwidth_ratio(n):
    algbw = 3.7
    row = PerfRow(size_bytes=8, count=2, time_us=100.0, algbw_gbps=algbw, busbw_gbps=algbw * 2 * (n - 1) / n)
    assert ring_ranks(row) == n
