"""``meridian bench lab --rounds N``: the order of a round's three jobs, and how a row sums its rounds up (no lab)."""

from __future__ import annotations

import pytest

from meridian.bench.lab import WAYS, round_order, row_of


def test_each_round_starts_with_the_next_way() -> None:
    assert [round_order(i)[0] for i in range(4)] == ["lab", "emulated", "one_dc", "lab"]
    for i in range(3):
        assert sorted(round_order(i)) == sorted(WAYS)


def _way(step_ms: float, **extra: float) -> dict:
    return {"step_ms": step_ms, "sync_wait_ms": step_ms / 10, "steps_timed": 12, "timed_steps": [3, 14],
            "reported": 7_000_000.0, "ranks_cpu_ms": 2 * step_ms, "ranks_system_cpu_ms": step_ms / 5,
            "kernel": 7_100_000.0, **extra}  # fmt: skip


def _round(lab: float, emulated: float, one_dc: float, no_overlap: float | None = None) -> dict[str, dict]:
    r = {"lab": _way(lab, delay_line_cpu_ms=lab / 20), "emulated": _way(emulated), "one_dc": _way(one_dc)}
    if no_overlap is not None:
        r["no_overlap"] = _way(no_overlap)
    return r


def test_a_row_gives_the_median_of_each_rounds_own_ratio() -> None:
    # The machine ran the second round twice as slowly: each round's ratios still compare jobs of the same round.
    rounds = [_round(200, 190, 180, 210), _round(400, 420, 380, 440), _round(210, 189, 200, 220)]
    row = row_of(21.0, 1.0, "hierarchical", "native", rounds, har_min=7_002_112)
    assert row["rounds"] == 3
    assert row["step_ms_lab"] == 210 and row["step_ms_emulated"] == 190 and row["step_ms_one_dc"] == 200
    assert row["emulated_vs_lab_rounds"] == [0.95, 1.05, 0.9]
    assert row["emulated_vs_lab"] == 0.95  # not 190 / 210 = 0.905, the ratio of the medians
    assert row["scaling_efficiency_rounds"] == [0.9, 0.95, 0.952]
    assert row["scaling_efficiency"] == 0.95
    assert row["overlap_saving"] == pytest.approx(round(1 - 200 / 210, 3))  # rounds: 0.048, 0.091, 0.045
    assert row["reported_vs_kernel"] == round(7_000_000 / 7_100_000, 4)
    assert row["delay_line_cpu_ms_per_step"] == 10.5  # the median of 10, 20, 10.5


def test_one_round_is_that_rounds_figures() -> None:
    row = row_of(100.0, 0.1, "flat", "python", [_round(500, 520, 250)], har_min=7_002_112)
    assert (row["step_ms_lab"], row["emulated_vs_lab"], row["scaling_efficiency"]) == (500, 1.04, 0.5)
    assert "overlap_saving" not in row  # no job with overlap off was run
