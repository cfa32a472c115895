"""The lab worker's sink: heartbeats kept per step, and the link counter read only after the steps asked for (each
read costs the loop a share of a short step that the bench would count against the job)."""

from __future__ import annotations

from meridian.bench.lab_worker import LabSink


def _beats(sink: LabSink, steps: int) -> None:
    for step in range(1, steps + 1):
        sink.rank_step({"phase": "computed", "step": step})
        sink.rank_step({"phase": "done", "step": step, "step_s": 0.01, "sync_wait_s": 0.0, "time": float(step)})


def test_the_link_counter_is_read_only_after_the_steps_named():
    named = LabSink("lo", count_at=frozenset({1, 4}))
    _beats(named, 5)
    assert sorted(named.counters) == [1, 4]
    assert named.counters[4] >= named.counters[1] >= 0
    assert [b["step"] for b in named.beats] == [1, 2, 3, 4, 5]  # every step's heartbeat is kept
    every = LabSink("lo")
    _beats(every, 3)
    assert sorted(every.counters) == [1, 2, 3]
    assert LabSink().counters == {}
