"""Races and holes of the control plane, stepped deterministically against the fake launcher (issue 19):
cancels racing admission and placement, two writers of one job, launch timeouts, deadlines, per-job
isolation of the loop, idempotency."""

from __future__ import annotations

import time

import pytest
from fakes import FakeService, step_record, topology
from fastapi.testclient import TestClient

import meridian.service.store as store_module
from meridian.api.app import create_app
from meridian.service.errors import InvalidTransition
from meridian.service.jobs import JobRequest, JobState, JobStatus, TopologyRequest
from meridian.service.store import JobStore
from meridian.workers.contracts.model_config import model_preset


def req(name="j", workers=None, datacenters=None) -> JobRequest:
    return JobRequest(name=name, model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2,
                      topology=TopologyRequest(workers_per_datacenter=workers, datacenters=datacenters))


@pytest.fixture
def fake_client(store, supervisor, cluster_view):
    fake = FakeService(store, supervisor, cluster_view)
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1") as c:
        yield c


# -- 1. cancelled jobs keep training ----------------------------------------------------------------------

def test_a_cancel_while_the_supervisor_admits_the_job_wins_and_nothing_is_launched(supervisor, store):
    job, _ = supervisor.submit(req(), {})
    queued_in_order = store.queued_in_order

    def read_queue_then_cancel():  # the DELETE lands after the queue was read, before PLACING
        queue = queued_in_order()
        supervisor.cancel(job.id)
        return queue

    store.queued_in_order = read_queue_then_cancel
    supervisor.tick()
    assert store.get_job(job.id).status.state is JobState.CANCELLED
    assert supervisor.launcher.launched == []


def test_the_plan_and_config_fixed_at_submit_are_what_the_runner_gets_though_the_cluster_changed(
        supervisor, store, cluster_view):
    job, created = supervisor.submit(req(), {})
    stored = store.get_job(job.id).resolved
    assert created and stored is not None and stored.plan.num_workers == 4
    cluster_view.topo = topology(dc_a=3, dc_b=3)  # more room now: a new plan would differ; the job keeps its own
    supervisor.tick()
    _, config, plan = supervisor.launcher.launched[0]
    assert plan == stored.plan and config == stored.config and config.job_id == job.id
    assert store.get_job(job.id).plan == stored.plan.to_dict() == job.plan


def test_a_job_whose_stored_plan_the_cluster_cannot_hold_any_more_is_unschedulable_and_others_pass(
        supervisor, store, cluster_view):
    job, _ = supervisor.submit(req(), {})  # planned on 2 + 2 nodes
    cluster_view.topo = topology(dc_a=2, dc_b=1)  # a node left: the plan cannot be held however long it waits
    fits, _ = supervisor.submit(req("fits", workers=1, datacenters=("dc-a",)), {})
    supervisor.tick()
    head = store.get_job(job.id)
    assert head.status.reason == "Unschedulable" and "resubmit" in head.status.message
    assert "dc-b" in head.status.message
    assert store.get_job(fits.id).status.state is JobState.PLACING
    assert [j for j, _, _ in supervisor.launcher.launched] == [fits.id]


def test_a_cancel_while_placing_before_the_runner_exists_reaches_the_runner_and_ends_cancelled(supervisor, store):
    job, _ = supervisor.submit(req(), {})
    launcher = supervisor.launcher
    launcher.on_launch = lambda job_id: supervisor.cancel(job_id)  # the DELETE lands while Ray creates the runner
    supervisor.tick()  # admits, launches (the cancel finds no runner to tell), then follows the job
    runner = launcher.runners[job.id]
    assert runner.cancelled, "the runner of a job with a cancel request must be told to stop"
    runner.state = "running"  # a step finished before the runner saw the cancel
    supervisor.tick()
    job_now = store.get_job(job.id)
    assert job_now.status.reason == "Cancelling" and job_now.cancel_requested
    runner.state = "cancelled"
    supervisor.tick()
    assert store.get_job(job.id).status.state is JobState.CANCELLED
    assert launcher.released == [job.id]


# -- 2. transitions are compare-and-set in the database ---------------------------------------------------

def test_two_interleaved_writers_cannot_turn_a_cancelled_job_back_into_running(database_url, monkeypatch):
    a, b = JobStore(database_url), JobStore(database_url)  # two writers, two connection pools
    job, _ = a.create_job(req(), {}, status=JobStatus(JobState.QUEUED))
    a.set_status(job.id, JobStatus(JobState.PLACING))
    real_transition = store_module.transition
    interleaved = []

    def transition_after_the_other_writer(current, new):
        if not interleaved:  # writer A has read "placing"; writer B cancels before A writes
            interleaved.append(True)
            b.set_status(job.id, JobStatus(JobState.CANCELLED, "Cancelled"))
        return real_transition(current, new)

    monkeypatch.setattr(store_module, "transition", transition_after_the_other_writer)
    with pytest.raises(InvalidTransition):
        a.set_status(job.id, JobStatus(JobState.RUNNING, "Training"))
    final = b.get_job(job.id)
    assert final.status.state is JobState.CANCELLED
    states = [e.data["state"] for e in b.list_events(job.id) if e.kind == "state"]
    assert states == ["queued", "placing", "cancelled"]
    a.close()
    b.close()


def test_set_status_with_expect_refuses_a_job_in_another_state(store):
    job, _ = store.create_job(req(), {}, status=JobStatus(JobState.QUEUED))
    store.set_status(job.id, JobStatus(JobState.CANCELLED))
    with pytest.raises(InvalidTransition, match="cancelled, not queued"):
        store.set_status(job.id, JobStatus(JobState.PLACING), expect={JobState.QUEUED})


# -- 3. a launch timeout kills the runner -----------------------------------------------------------------

def test_a_launch_that_times_out_kills_the_runner_it_created(supervisor, store):
    job, _ = supervisor.submit(req(), {})
    supervisor.launcher.launch_error = TimeoutError("the runner did not start within 60 s")
    supervisor.tick()
    job = store.get_job(job.id)
    assert (job.status.state, job.status.reason) == (JobState.FAILED, "LaunchFailed")
    assert supervisor.launcher.released == [job.id] and job.id not in supervisor.launcher.runners


# -- 4. nothing stuck forever -----------------------------------------------------------------------------

def test_a_job_stuck_placing_says_so_to_the_jobs_behind_it_then_fails_at_its_deadline(supervisor, store):
    from meridian.service.supervision.reconcile import Deadlines

    stuck, _ = supervisor.submit(req("stuck"), {})
    behind, _ = supervisor.submit(req("behind", workers=1), {})
    supervisor.tick()  # "stuck" is placing; its runner never gets a worker
    supervisor.tick()
    status = store.get_job(behind.id).status
    assert (status.state, status.reason) == (JobState.QUEUED, "WaitingForPlacement") and stuck.id in status.message
    supervisor.deadlines = Deadlines(placing_s=0.0)
    supervisor.tick()
    job = store.get_job(stuck.id)
    assert (job.status.state, job.status.reason) == (JobState.FAILED, "PlacingTimedOut")
    assert supervisor.launcher.released == [stuck.id]
    supervisor.deadlines = Deadlines()
    supervisor.tick()
    assert store.get_job(behind.id).status.state is JobState.PLACING


def test_a_cancel_the_runner_never_answers_ends_at_its_deadline_with_the_runner_killed(supervisor, store):
    from meridian.service.supervision.reconcile import Deadlines

    job, _ = supervisor.submit(req(), {})
    supervisor.tick()
    supervisor.launcher.runners[job.id].state = "running"
    supervisor.tick()
    supervisor.cancel(job.id)
    supervisor.tick()
    assert store.get_job(job.id).status.reason == "Cancelling"  # within the deadline it waits
    supervisor.deadlines = Deadlines(cancel_s=0.0)
    supervisor.tick()
    job = store.get_job(job.id)
    assert (job.status.state, job.status.reason) == (JobState.CANCELLED, "CancelTimedOut")
    assert supervisor.launcher.released == [job.id]
    assert supervisor.launcher.swept == [job.id]  # the killed runner cannot remove its workers' RAM snapshots


def test_the_deadlines_hold_when_the_runner_does_not_answer_and_the_failure_is_reported(supervisor, store):
    from meridian.service.supervision.reconcile import Deadlines

    stuck, _ = supervisor.submit(req("stuck"), {})
    behind, _ = supervisor.submit(req("behind", workers=1), {})
    supervisor.tick()  # "stuck" is placing
    timeout = TimeoutError("GetTimeoutError: Get timed out: some object(s) not ready (10 s)")
    supervisor.launcher.poll_errors[stuck.id] = timeout
    supervisor.tick()
    supervisor.tick()
    # within the deadline: retried, and said once (an event, /healthz degraded), not once per tick
    assert store.get_job(stuck.id).status.state is JobState.PLACING
    assert [e.kind for e in store.list_events(stuck.id)].count("supervisor_error") == 1
    assert supervisor.health()["status"] == "degraded"
    # Past it: the job fails and its runner is killed, though the runner never answered (before: placing forever,
    # and every job behind it queued).
    supervisor.deadlines = Deadlines(placing_s=0.0)
    supervisor.tick()
    job = store.get_job(stuck.id)
    assert (job.status.state, job.status.reason) == (JobState.FAILED, "PlacingTimedOut")
    assert supervisor.launcher.released == [stuck.id] and supervisor.launcher.swept == [stuck.id]
    supervisor.deadlines = Deadlines()
    supervisor.tick()
    assert store.get_job(behind.id).status.state is JobState.PLACING and supervisor.health()["status"] == "ok"
    # The same for a cancel: a running job whose runner stops answering after the cancel request.
    supervisor.launcher.runners[behind.id].state = "running"
    supervisor.tick()
    supervisor.cancel(behind.id)
    supervisor.launcher.poll_errors[behind.id] = timeout
    supervisor.deadlines = Deadlines(cancel_s=0.0)
    supervisor.tick()
    job = store.get_job(behind.id)
    assert (job.status.state, job.status.reason) == (JobState.CANCELLED, "CancelTimedOut")
    assert supervisor.launcher.released == [stuck.id, behind.id]


def test_a_job_stored_before_submits_resolved_it_whose_config_cannot_be_built_fails_alone(supervisor, store):
    """A job a service older than submit-time resolution stored (no plan and config with it) is resolved once at
    admission; if its options make no valid config it fails alone (before: raised every tick, and no other job
    was admitted or followed), and the running job's records are still stored."""
    from dataclasses import replace

    from fakes import step_record

    from meridian.service.jobs import ParallelismRequest

    running, _ = supervisor.submit(req("running", workers=1), {})
    supervisor.tick()
    runner = supervisor.launcher.runners[running.id]
    runner.state = "running"
    supervisor.tick()  # running: the next job may be admitted
    # a pipeline's replicas must cut their samples into equal micro-batches: only the plan knows the replicas
    old = replace(req("bad", workers=1), global_batch=3, micro_batch=2, parallelism=ParallelismRequest(pp=2))
    bad, _ = store.create_job(old, {}, status=JobStatus(JobState.QUEUED, "Admitting"))
    assert bad.resolved is None
    runner.push("record", step_record(1, 3, 5.0))
    supervisor.tick()
    job = store.get_job(bad.id)
    assert (job.status.state, job.status.reason) == (JobState.FAILED, "InvalidConfig")
    assert "training.micro_batch (2) must divide" in job.status.message and "submit again" in job.status.message
    assert [m["step"] for m in store.list_metrics(running.id)] == [1]
    assert [j for j, _, _ in supervisor.launcher.launched] == [running.id]


def test_a_job_stored_before_submits_resolved_it_is_resolved_once_and_launched_with_that(supervisor, store):
    old, _ = store.create_job(req("old", workers=1), {}, status=JobStatus(JobState.QUEUED, "Admitting"))
    supervisor.tick()
    stored = store.get_job(old.id)
    assert stored.resolved is not None and stored.status.state is JobState.PLACING
    _, config, plan = supervisor.launcher.launched[0]
    assert (config, plan) == (stored.resolved.config, stored.resolved.plan) and config.job_id == old.id


def test_an_admission_that_raises_still_lets_the_running_jobs_be_followed(supervisor, store, monkeypatch):
    from fakes import step_record

    running, _ = supervisor.submit(req("running", workers=1), {})
    supervisor.tick()
    runner = supervisor.launcher.runners[running.id]
    runner.state = "running"
    runner.push("record", step_record(1, 3, 5.0))

    def broken(topo):
        raise RuntimeError("the planner has a bug")

    monkeypatch.setattr(supervisor, "_admit", broken)
    with pytest.raises(RuntimeError, match="the planner has a bug"):  # the tick still fails, and says so
        supervisor.tick()
    assert [m["step"] for m in store.list_metrics(running.id)] == [1]  # after following the running job


def test_an_unschedulable_head_of_queue_does_not_block_jobs_that_fit(supervisor, store, cluster_view):
    head, _ = supervisor.submit(req("head", workers=2, datacenters=("dc-a", "dc-b")), {})
    fits, _ = supervisor.submit(req("fits", workers=1, datacenters=("dc-a",)), {})
    cluster_view.topo = topology(dc_a=2)  # dc-b is gone: the head cannot run at all now
    supervisor.tick()
    assert store.get_job(head.id).status.reason == "Unschedulable"
    assert store.get_job(fits.id).status.state is JobState.PLACING


def test_an_error_following_one_job_is_recorded_on_it_and_the_others_are_still_followed(supervisor, store, fake_client):
    runners = supervisor.launcher.runners
    bad, _ = supervisor.submit(req("bad", workers=1), {})
    supervisor.tick()
    runners[bad.id].state = "running"
    good, _ = supervisor.submit(req("good", workers=1), {})
    supervisor.tick()
    supervisor.tick()
    runners[good.id].state = "running"
    runners[bad.id].push("record", step_record(1, 3, 5.0, step_s=None))  # reconcile raises folding it
    runners[good.id].push("record", step_record(1, 3, 5.0))
    supervisor.tick()
    assert store.get_job(good.id).progress["step"] == 1
    errors = [e for e in store.list_events(bad.id) if e.kind == "supervisor_error"]
    assert len(errors) == 1 and "TypeError" in errors[0].message
    supervisor.tick()  # the same error is not recorded twice
    assert len([e for e in store.list_events(bad.id) if e.kind == "supervisor_error"]) == 1
    health = fake_client.get("/healthz").json()
    assert health["status"] == "degraded" and health["jobs_failing"] == 1
    assert "kind" not in str(health)  # no exception text


def test_healthz_is_failing_while_ticks_fail(supervisor, fake_client):
    def broken():
        raise RuntimeError("secret path /home/other/data")

    supervisor.read_topology = broken
    supervisor.start()
    try:
        deadline = time.monotonic() + 10
        while not supervisor.last_tick_error and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        supervisor.stop()
    r = fake_client.get("/healthz")
    assert r.status_code == 503 and r.json()["status"] == "failing"
    assert "secret" not in r.text


# -- 5. idempotency ---------------------------------------------------------------------------------------

def test_a_retry_with_the_same_key_returns_the_job_even_after_the_cluster_changed(supervisor, cluster_view):
    first, created = supervisor.submit(req(datacenters=("dc-a", "dc-b")), {"b": 1}, idempotency_key="k1")
    cluster_view.topo = topology(dc_a=2)  # the job could not be planned any more
    again, created_again = supervisor.submit(req(datacenters=("dc-a", "dc-b")), {"b": 1}, idempotency_key="k1")
    assert created and not created_again and again.id == first.id


def test_a_different_body_with_the_same_key_is_refused_with_a_clear_message(supervisor, fake_client):
    from meridian.service.errors import IdempotencyConflict

    first, _ = supervisor.submit(req("one"), {"name": "one"}, idempotency_key="k1")
    with pytest.raises(IdempotencyConflict, match=f"already used for job {first.id} with a different request body"):
        supervisor.submit(req("two"), {"name": "two"}, idempotency_key="k1")
    body = {"name": "a", "model": {"preset": "nano"}, "training": {"steps": 4, "global_batch": 4, "micro_batch": 2}}
    assert fake_client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k2"}).status_code == 201
    assert fake_client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k2"}).status_code == 200
    r = fake_client.post("/v1/jobs", json={**body, "name": "b"}, headers={"Idempotency-Key": "k2"})
    assert r.status_code == 422 and "different request body" in r.json()["detail"]


def test_a_stall_named_before_a_restart_is_not_recorded_again(supervisor, store, cluster_view, tmp_path):
    # The runner names a stall once (its LivenessWatch lives as long as the job) and the poll's cursor stores it
    # once: a restarted service reads nothing back to avoid naming it again.
    from meridian.service.supervision.supervisor import Supervisor
    from meridian.workers.contracts.events import EventKind, JobEvent, StallSeen

    job, _ = supervisor.submit(req(), {})
    supervisor.tick()
    runner = supervisor.launcher.runners[job.id]
    runner.state = "running"
    stall = StallSeen(rank=1, step=4, silent_s=11.0, threshold_s=3.0, median_step_s=1.0, node_id="n1", datacenter="dc-b")
    runner.push("event", JobEvent(kind=EventKind.STALL, message="rank 1 in dc-b is quiet", payload=stall, time=101.0))
    runner.stalls = (stall,)
    supervisor.tick()
    supervisor.tick()
    assert len([e for e in store.list_events(job.id) if e.kind == "stall"]) == 1
    again = Supervisor(store, supervisor.launcher, cluster_view, checkpoint_root=str(tmp_path))  # the service restarted
    again.tick()
    assert len([e for e in store.list_events(job.id) if e.kind == "stall"]) == 1
