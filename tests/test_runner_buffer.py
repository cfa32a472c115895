"""The runner keeps records until the service acknowledges them (the cursor it polls with), and a loss is
never silent: a ``gap`` event names it (issue 19)."""

from __future__ import annotations

from fakes import job_runner, step_record

from meridian.service.jobs import JobRequest, JobState, JobStatus
from meridian.service.runner.actor import JobRunner
from meridian.service.supervision.reconcile import reconcile
from meridian.workers.contracts.model_config import model_preset


class NoExport:
    def export(self, _state):
        pass


def runner() -> JobRunner:
    return job_runner(NoExport())


def test_records_a_slow_service_has_not_acknowledged_are_kept_beyond_twenty_thousand():
    r = runner()
    r.push_progress([step_record(s, 30_000, 1.0) for s in range(1, 25_001)])
    poll = r.poll(0)  # the service was away: it has stored nothing yet
    assert len(poll.records) == 25_000 and poll.records[0].step == 1
    assert not [e for e in poll.events if e.kind == "gap"]


def test_acknowledged_records_are_trimmed_and_unacknowledged_ones_survive_a_retried_poll():
    r = runner()
    r.push_progress([step_record(s, 10, 1.0) for s in range(1, 4)])
    first = r.poll(0)
    again = r.poll(0)  # the service died before storing the first poll: it asks again from its stored cursor
    assert [x.step for x in again.records] == [1, 2, 3]
    r.push_progress([step_record(4, 10, 1.0)])
    assert [x.step for x in r.poll(first.cursor).records] == [4]
    assert len(r._reports.outbox) == 1  # 1–3 were acknowledged by the cursor and trimmed


def test_a_loss_beyond_the_unacknowledged_limit_is_a_gap_event_stored_with_the_job(store):
    r = runner()
    r._reports.outbox.max_unacked = 5
    r.push_event("worker_started", "rank 0", {"rank": 0, "node_id": "n0", "datacenter": "dc-a"})
    r.push_progress([step_record(s, 10, 1.0) for s in range(1, 8)])  # 8 entries, room for 5
    poll = r.poll(0)
    assert [x.step for x in poll.records] == [3, 4, 5, 6, 7]
    gap = poll.events[0]
    assert gap.kind == "gap" and gap.data == {"after": 0, "through": 3, "lost": 3}
    job, _ = store.create_job(JobRequest(name="j", model=model_preset("nano"), steps=3, global_batch=4,
                                         micro_batch=2), {}, status=JobStatus(JobState.QUEUED))
    d = reconcile(store.get_job(job.id), poll)
    store.record_poll(job.id, records=[x.to_dict() for x in d.records], events=list(d.events), **d.fields)
    assert "gap" in [e.kind for e in store.list_events(job.id)]
    assert not [e for e in r.poll(poll.cursor).events if e.kind == "gap"]  # said once the service stored it


def test_steps_trained_but_never_recorded_before_a_break_are_named_by_the_next_epochs_first_record():
    """Rank 0 reads a step's loss a window of steps late: at a break the steps in flight were trained and kept
    but never get a record. The first record of the next epoch shows where training resumed."""
    r = runner()
    r.push_progress([step_record(s, 40, 1.0, epoch=1) for s in range(1, 11)])
    r.push_progress([step_record(s, 40, 1.0, epoch=2) for s in range(13, 16)])  # resumed after step 12
    r.push_progress([step_record(s, 40, 1.0, epoch=3) for s in range(15, 18)])  # after 14: 15 trained again
    r.push_progress([step_record(s, 40, 1.0, epoch=4) for s in range(19, 20)])  # after 18: one step unrecorded
    unrecorded = [e for e in r.poll(0).events if e.kind == "steps_unrecorded"]
    assert [e.data for e in unrecorded] == [{"from_step": 11, "to_step": 12, "epoch": 2},
                                               {"from_step": 18, "to_step": 18, "epoch": 4}]  # fmt: skip
    assert unrecorded[0].message.startswith("steps 11–12 trained and kept before epoch 2 formed have no record")
    assert unrecorded[1].message.startswith("step 18 trained and kept before epoch 4 formed has no record")


def test_a_first_epoch_that_starts_from_a_checkpoint_names_no_steps():
    r = runner()
    r.push_progress([step_record(s, 900, 1.0, epoch=1) for s in range(501, 504)])  # resumed a checkpoint of step 500
    assert not [e for e in r.poll(0).events if e.kind == "steps_unrecorded"]
