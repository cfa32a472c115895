"""A job's placement (one entry per rank) crosses from the runner to the service only when it changed, and the API
validates a stored placement once per distinct text: a job of thousands of ranks no longer costs an N-entry copy in
every poll and N models in every GET."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

from meridian.api.schemas import JobPublic
from meridian.service.jobs import JobState, JobStatus
from meridian.service.runner.poll import RunnerPoll, RunnerState
from meridian.service.runner.reports import Reports
from meridian.service.store import JobRecord
from meridian.service.supervision.reconcile import reconcile


def _formed(reports: Reports, epoch: int, n: int) -> None:
    reports.add_event("epoch_formed", f"epoch {epoch}", {
        "epoch": epoch, "datacenters": ["dc-a"] * n, "resume_step": 0,
        "placement": [{"rank": r, "worker_id": f"w{r}", "node_id": f"n{r}", "datacenter": "dc-a"} for r in range(n)]})


def test_the_runner_sends_the_placement_until_the_service_has_acknowledged_the_event_that_changed_it():
    r = Reports("j1", threading.Lock())
    assert r.placement_since(0) is None  # nothing placed yet
    _formed(r, 1, 4)
    seq = r.outbox.seq
    assert [p.rank for p in r.placement_since(seq - 1)] == [0, 1, 2, 3]
    assert r.placement_since(seq) is None  # the service stored it with this cursor
    r.add_event("waiting", "2 of 4 reachable workers are back", {})  # another event: the ranks did not change
    assert r.placement_since(seq) is None
    _formed(r, 2, 3)
    assert [p.rank for p in r.placement_since(seq)] == [0, 1, 2]


def _job(placement: list | None, placement_json: str | None = None) -> JobRecord:
    return JobRecord(
        id="j1", seq=1, name="j", owner="", priority=0, status=JobStatus(JobState.RUNNING, "Training", ""),
        request_json="{}", spec={}, plan=None, placement=placement, progress=None, result=None, runner="r",
        created_at=0.0, updated_at=0.0, started_at=None, finished_at=None, placement_json=placement_json)


def test_a_poll_without_the_placement_keeps_the_stored_one():
    stored = [{"rank": 0, "worker_id": "w0", "node_id": "n0", "datacenter": "dc-a"}]
    d = reconcile(_job(stored), RunnerPoll(state=RunnerState.RUNNING, placement=None, cursor=9))
    assert "placement" not in d.fields and d.fields["progress"]["cursor"] == 9


def test_a_stored_placement_renders_as_when_validated_entry_by_entry():
    placement = [{"rank": r, "worker_id": f"w{r}", "node_id": f"n{r}", "datacenter": "dc-b", "hostname": f"h{r}",
                  "pid": 100 + r, "ray_worker_id": "x", "device": "cpu"} for r in range(5)]
    text = json.dumps(placement)
    plain = JobPublic.from_record(_job(placement))
    cached = JobPublic.from_record(_job(placement, text))
    assert cached.model_dump_json() == plain.model_dump_json()
    again = JobPublic.from_record(replace(_job(placement, text), updated_at=5.0))
    assert again.placement[3] is cached.placement[3]  # validated once for the same text
    assert again.updated_at == 5.0
    assert JobPublic.from_record(_job([], "[]")).placement == []
