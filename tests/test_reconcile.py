"""The supervisor's decisions, asserted directly: one job as stored + one runner poll → one Decision.

No Ray, no store, no clock: :func:`reconcile` is pure, so each rule of following a job is one call here."""

from __future__ import annotations

from dataclasses import replace

from fakes import step_record

from meridian.service.jobs import JobState, JobStatus
from meridian.service.runner.placement import PlacedRank, PlacementTracker
from meridian.service.runner.poll import RunnerLost, RunnerPoll, RunnerState
from meridian.service.store import JobRecord
from meridian.service.supervision.reconcile import reconcile
from meridian.workers.contracts.events import EventKind, JobEvent


def job(state: JobState = JobState.RUNNING, reason: str = "Training", message: str = "", *,
        cancel_requested: bool = False, progress: dict | None = None, placement: list | None = None) -> JobRecord:
    return JobRecord(
        id="j1", seq=1, name="j", owner="", priority=0, status=JobStatus(state, reason, message), request_json="{}",
        spec={}, plan=None, placement=placement, progress=progress, result=None, runner="meridian-job-j1",
        created_at=0.0, updated_at=0.0, started_at=None, finished_at=None, cancel_requested=cancel_requested,
    )


def poll(state: RunnerState = RunnerState.RUNNING, **fields) -> RunnerPoll:
    return RunnerPoll(state=state, **fields)


def test_runner_succeeded_completes_the_job_stores_the_result_and_releases_the_runner():
    d = reconcile(job(), poll(RunnerState.SUCCEEDED, result={"final_loss": 3.0}, cursor=7))
    assert d.outcome == JobStatus(JobState.SUCCEEDED, "Completed", "training finished")
    assert d.release and d.forget and d.store
    assert d.fields["result"] == {"final_loss": 3.0} and d.fields["progress"]["cursor"] == 7
    assert d.status is None


def test_runner_failed_fails_the_job_with_its_message():
    d = reconcile(job(), poll(RunnerState.FAILED, error="RuntimeError: data.source '/x' cannot be read"))
    assert d.outcome == JobStatus(JobState.FAILED, "TrainingError", "RuntimeError: data.source '/x' cannot be read")
    assert d.release and d.forget
    assert reconcile(job(), poll(RunnerState.FAILED)).outcome == JobStatus(JobState.FAILED, "TrainingError",
                                                                           "training failed")


def test_runner_cancelled_cancels_the_job_and_releases_it():
    d = reconcile(job(reason="Cancelling", cancel_requested=True), poll(RunnerState.CANCELLED))
    assert d.outcome is not None and d.outcome.state is JobState.CANCELLED and d.outcome.reason == "Cancelled"
    assert d.release and d.forget


def test_running_with_a_wait_reason_says_the_job_waits_for_workers_once():
    reason = "1 worker(s) left after losing 3; the job needs at least 2 (topology.min_workers)"
    d = reconcile(job(), poll(wait_reason=reason))
    assert d.status == JobStatus(JobState.RUNNING, "WaitingForWorkers", reason)
    assert d.outcome is None and not d.release
    # Already saying so: nothing new to set.
    assert reconcile(job(reason="WaitingForWorkers", message=reason), poll(wait_reason=reason)).status is None


def test_first_running_poll_of_a_placing_job_says_training():
    assert reconcile(job(JobState.PLACING, "Placing"), poll()).status == JobStatus(
        JobState.RUNNING, "Training", "training steps are running")
    assert reconcile(job(reason="WaitingForWorkers", message="x"), poll()).status.reason == "Training"
    assert reconcile(job(), poll()).status is None  # already training
    assert reconcile(job(JobState.PLACING, "Placing"), poll(RunnerState.STARTING)).status is None


def test_a_job_being_cancelled_keeps_saying_so_until_its_runner_stops():
    d = reconcile(job(JobState.PLACING, "Cancelling", cancel_requested=True), poll())
    assert d.status is None and d.outcome is None and not d.release


def test_cancel_requested_and_runner_lost_is_the_cancel_done():
    d = reconcile(job(reason="Cancelling", cancel_requested=True), RunnerLost("actor died"))
    assert d.outcome == JobStatus(JobState.CANCELLED, "Cancelled",
                                  "cancelled by request; workers stopped and placement freed")
    assert not d.store and d.forget and not d.release
    assert d.sweep_snapshots  # the runner that would have removed its workers' RAM snapshots is gone


def test_runner_lost_without_relaunches_left_fails_the_job_with_what_ray_said():
    d = reconcile(job(), RunnerLost("The actor died because its node died"), max_relaunches=0)
    assert d.outcome is not None and (d.outcome.state, d.outcome.reason) == (JobState.FAILED, "RunnerLost")
    assert "resubmit" in d.outcome.message and "its node died" in d.outcome.message
    assert '"resume_from": {"job": "j1"}' in d.outcome.message
    assert not d.store and d.forget and d.sweep_snapshots and d.release
    spent = reconcile(replace(job(), relaunches=3), RunnerLost("actor died"), max_relaunches=3)
    assert spent.outcome.state is JobState.FAILED and "after 3 relaunch(es), the most this service allows" in \
        spent.outcome.message and "--max-relaunches" in spent.outcome.message


def test_runner_lost_queues_the_job_again_from_its_checkpoint_a_bounded_number_of_times():
    running = job(progress={"cursor": 41, "step": 20}, placement=[{"rank": 0}])
    d = reconcile(running, RunnerLost("The actor died unexpectedly"), now=7.0, max_relaunches=3)
    assert d.outcome == JobStatus(JobState.QUEUED, "Relaunching", d.outcome.message)
    assert "relaunch 1 of at most 3" in d.outcome.message
    assert d.store and d.forget and not d.sweep_snapshots  # its folders: the next runner's
    assert d.release  # what its dead runner's controllers hold (their placement groups) is freed
    assert d.fields["relaunches"] == 1 and d.fields["placement"] == []
    assert d.fields["progress"] == {"cursor": 0, "step": 20}  # the next runner reports from 0
    (event,) = d.events
    assert event.kind is EventKind.RUNNER_RELAUNCHED and event.time == 7.0
    assert event.data == {"attempt": 1, "max_relaunches": 3, "reason": "The actor died unexpectedly"}
    third = reconcile(replace(running, relaunches=2), RunnerLost("gone"), max_relaunches=3)
    assert third.outcome.state is JobState.QUEUED and third.fields["relaunches"] == 3
    assert third.events[0].data["attempt"] == 3
    # A job being cancelled is not relaunched: its runner's end is the cancel done.
    assert reconcile(job(reason="Cancelling", cancel_requested=True), RunnerLost("x")).outcome.state is \
        JobState.CANCELLED


def test_a_new_runner_that_loads_a_checkpoint_past_the_last_stored_record_names_the_steps_without_one():
    # The lost runner had steps 29 and 30 trained (the checkpoint of step 30 holds them) but not yet read.
    stored_progress = {"cursor": 0, "step": 28, "total_steps": 60, "step_s_ema": 0.3}
    relaunched = job(JobState.PLACING, "Placing", progress=stored_progress)
    loaded = JobEvent.parsed_or_malformed("checkpoint_loaded", "resumed from the durable checkpoint of step 30",
                                          {"step": 30, "bytes_read": 1, "bytes_stored": 1})
    d = reconcile(relaunched, poll(events=(loaded,)), now=5.0, progress_due=False)
    (named,) = [e for e in d.events if e.kind is EventKind.STEPS_UNRECORDED]
    assert (named.data["from_step"], named.data["to_step"], named.time) == (29, 30, 5.0)
    assert named.message.startswith("steps 29–30 trained and kept in the checkpoint of step 30 have no record")
    # Every record up to the checkpoint's step stored, or an older checkpoint loaded: nothing is missing.
    for stored in (30, 35):
        d = reconcile(job(progress={**stored_progress, "step": stored}), poll(events=(loaded,)), progress_due=False)
        assert not [e for e in d.events if e.kind is EventKind.STEPS_UNRECORDED]


def test_records_fold_into_progress_with_a_progress_event_only_when_due():
    recs = (step_record(1, 3, 5.0), step_record(2, 3, 4.0))
    d = reconcile(job(progress={"cursor": 0}), poll(records=recs, cursor=2))
    assert d.records == recs
    p = d.fields["progress"]
    assert (p["step"], p["total_steps"], p["loss"], p["first_loss"], p["cursor"]) == (2, 3, 4.0, 5.0, 2)
    assert p["eta_s"] > 0
    assert [ev.kind for ev in d.events] == [EventKind.PROGRESS] and d.emits_progress
    assert d.events[0].message == "step 2/3 loss 4.0000" and d.events[0].payload.step == 2
    assert not reconcile(job(), poll(records=recs, cursor=2), progress_due=False).events


def test_a_restarted_service_resumes_a_runner_that_never_started_unless_it_was_cancelled():
    d = reconcile(job(JobState.PLACING, "Placing", progress={"cursor": 4}), poll(RunnerState.STARTING, cursor=4),
                  first_sight=True, now=123.0)
    assert d.resume
    assert d.events[0].kind is EventKind.REATTACHED and d.events[0].time == 123.0
    assert d.events[0].data == {"cursor": 4, "runner_state": "starting"}
    assert not reconcile(job(JobState.PLACING, "Cancelling", cancel_requested=True), poll(RunnerState.STARTING),
                         first_sight=True).resume
    assert not reconcile(job(), poll(), first_sight=True).resume  # running already
    assert not reconcile(job(JobState.PLACING, "Placing"), poll(RunnerState.STARTING)).resume  # followed


def test_an_epoch_names_the_ranks_with_what_each_worker_said_when_it_started():
    tracker = PlacementTracker()  # the runner's: it keeps what workers said when they started, for the job's life
    for wid, pid, node, dc in (("w0", 10, "n0", "dc-a"), ("w1", 11, "n1", "dc-b")):
        tracker.observe(JobEvent.of("worker_started", "", {"worker_id": wid, "pid": pid, "node_id": node,
                                                            "datacenter": dc, "hostname": f"h-{wid}"}))
    assert tracker.ranks == ()  # no epoch yet: no ranks
    tracker.observe(JobEvent.of("epoch_formed", "epoch 1", {"epoch": 1, "datacenters": ["dc-a", "dc-b"],
                                                            "resume_step": 0, "placement": [
        {"rank": 0, "worker_id": "w0", "node_id": "n0", "datacenter": "dc-a"},
        {"rank": 1, "worker_id": "w1", "node_id": "n1", "datacenter": "dc-b"}]}))
    assert tracker.ranks == (PlacedRank(rank=0, worker_id="w0", node_id="n0", datacenter="dc-a", hostname="h-w0", pid=10),
                             PlacedRank(rank=1, worker_id="w1", node_id="n1", datacenter="dc-b", hostname="h-w1", pid=11))
    d = reconcile(job(placement=[]), poll(placement=tracker.ranks))
    assert [(p["rank"], p["pid"], p["datacenter"]) for p in d.fields["placement"]] == [(0, 10, "dc-a"), (1, 11, "dc-b")]
    stored = job(placement=d.fields["placement"])
    assert "placement" not in reconcile(stored, poll(placement=tracker.ranks)).fields  # unchanged: not stored again


def test_the_result_s_losses_are_the_job_s_first_and_last_steps_not_its_last_epoch_s():
    # The workers' result covers their last epoch: re-formed at step 3 of 4, its first loss was step 4's; resumed
    # at the last step (a peer lost in the final checkpoint), it trained none and both losses were NaN.
    before = reconcile(job(), poll(records=(step_record(1, 4, 5.0), step_record(2, 4, 4.0)), cursor=2))
    running = job(progress=before.fields["progress"])
    d = reconcile(running, poll(RunnerState.SUCCEEDED, records=(step_record(3, 4, 3.5), step_record(4, 4, 3.0)),
                                result={"first_loss": 3.0, "final_loss": 3.0, "steps": 4}, cursor=4))
    assert d.fields["result"] == {"first_loss": 5.0, "final_loss": 3.0, "steps": 4}
    nan = float("nan")
    done = job(progress=d.fields["progress"])
    d = reconcile(done, poll(RunnerState.SUCCEEDED, result={"first_loss": nan, "final_loss": nan, "steps": 4}, cursor=4))
    assert d.fields["result"] == {"first_loss": 5.0, "final_loss": 3.0, "steps": 4}
