"""The planner's per-rank memory figure against each rank's measured peak in one training step of three multi-rank
layouts on CPU (gloo, fp32, the FSDP2 engine the workers run): FSDP over 4 ranks in one datacenter, 2 datacenters
of 2 ranks (sharded inside, replicated across), and FSDP over 4 ranks with full activation checkpointing. The
peak is the CPU allocator's live bytes (:mod:`meridian.bench.memory_cpu`); the figure must be within 15% of it."""

from __future__ import annotations

import pytest

from meridian.bench import memory_cpu

pytestmark = pytest.mark.slow

MICRO_BATCH, SEQ_LEN = 4, 256


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    return {lay.name: memory_cpu.measure(lay, MICRO_BATCH, SEQ_LEN) for lay in memory_cpu.LAYOUTS}


@pytest.mark.parametrize("name", [lay.name for lay in memory_cpu.LAYOUTS])
def test_the_planner_s_per_rank_figure_is_within_15_percent_of_the_measured_peak(rows, name):
    row = rows[name]
    assert 15e6 < row["params"] < 25e6  # the ~20M-parameter model
    assert 0.85 <= row["estimate_over_measured"] <= 1.15, row


def test_the_allocator_count_is_real_memory_and_tells_the_layouts_apart(rows):
    # The processes' RSS grew by at least the allocator's peak (RSS also holds the interpreter, torch and gloo).
    for row in rows.values():
        assert row["rss_growth_over_peak"] >= 0.9, row
    # Full checkpointing keeps less than every activation; the measurement sees it, and so does the planner.
    full, none = rows["fsdp-4-full-ckpt"], rows["fsdp-4"]
    assert full["measured_peak_bytes"] < none["measured_peak_bytes"]
    assert full["estimate_bytes"] < none["estimate_bytes"]
    # 2 ranks per datacenter hold half the model's state each, 4 ranks a quarter.
    assert rows["hsdp-2x2"]["measured_peak_bytes"] > none["measured_peak_bytes"]
