"""The control loop stepped one tick at a time against a fake launcher and a fake cluster."""

from __future__ import annotations

from fakes import node, step_record, topology

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.jobs import JobRequest, JobState, TopologyRequest
from meridian.service.supervision.supervisor import Supervisor
from meridian.workers.contracts.model_config import model_preset


def req(name="j", workers=None, priority=0) -> JobRequest:
    return JobRequest(name=name, model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2,
                      topology=TopologyRequest(workers_per_datacenter=workers), priority=priority)


def test_job_runs_from_queue_to_success_with_progress_placement_and_result(supervisor, store):
    job, _ = supervisor.submit(req(), {"name": "j"})
    assert job.status.state is JobState.QUEUED and job.plan["num_workers"] == 4
    supervisor.tick()
    job = store.get_job(job.id)
    assert job.status.state is JobState.PLACING
    (launched_id, config, plan), = supervisor.launcher.launched
    assert config.datacenters == ("dc-a", "dc-a", "dc-b", "dc-b") and config.sync.strategy.value == "hierarchical"

    runner = supervisor.launcher.runners[job.id]
    runner.push("event", {"kind": "worker_started", "message": "started", "time": 1.0,
                          "data": {"worker_id": "w1", "node_id": "n-dc-a-1", "datacenter": "dc-a", "pid": 11}})
    runner.push("event", {"kind": "epoch_formed", "message": "epoch 1", "time": 1.0, "data": {
        "epoch": 1, "datacenters": ["dc-a", "dc-a"], "resume_step": 0, "placement": [
        {"rank": 0, "worker_id": "w0", "node_id": "n-dc-a-0", "datacenter": "dc-a"},
        {"rank": 1, "worker_id": "w1", "node_id": "n-dc-a-1", "datacenter": "dc-a"}]}})
    runner.state = "running"
    runner.push("record", step_record(1, 3, 5.0))
    supervisor.tick()
    job = store.get_job(job.id)
    assert job.status.state is JobState.RUNNING
    assert [p["rank"] for p in job.placement] == [0, 1] and job.placement[1]["pid"] == 11
    assert job.progress["step"] == 1 and job.progress["eta_s"] > 0

    runner.push("record", step_record(2, 3, 4.0))
    runner.push("record", step_record(3, 3, 3.0))
    runner.result = {"first_loss": 5.0, "final_loss": 3.0}
    runner.state = "succeeded"
    supervisor.tick()
    job = store.get_job(job.id)
    assert job.status.state is JobState.SUCCEEDED and job.result["final_loss"] == 3.0
    assert [m["loss"] for m in store.list_metrics(job.id)] == [5.0, 4.0, 3.0]
    assert supervisor.launcher.released == [job.id]


def test_a_restarted_supervisor_resumes_from_the_stored_cursor_without_duplicates(supervisor, store, cluster_view, tmp_path):
    job, _ = supervisor.submit(req(), {})
    supervisor.tick()
    runner = supervisor.launcher.runners[job.id]
    runner.state = "running"
    runner.push("record", step_record(1, 3, 5.0))
    supervisor.tick()
    runner.push("record", step_record(2, 3, 4.0))

    # The service restarts: a new supervisor over the same store and the same live runners.
    again = Supervisor(store, supervisor.launcher, cluster_view, checkpoint_root=str(tmp_path))
    again.tick()
    again.tick()
    assert [m["step"] for m in store.list_metrics(job.id)] == [1, 2]


def test_fifo_queue_waits_with_a_reason_and_starts_when_capacity_frees(supervisor, store, cluster_view):
    first, _ = supervisor.submit(req("first"), {})
    second, _ = supervisor.submit(req("second", workers=1), {})
    supervisor.tick()
    supervisor.launcher.runners[first.id].state = "running"
    supervisor.tick()  # first is running; capacity is now taken
    cluster_view.topo = ClusterTopology(tuple(node(n.node_id, n.datacenter, free_cpus=0) for n in topology(dc_a=2, dc_b=2).nodes))
    supervisor.tick()
    second_job = store.get_job(second.id)
    assert second_job.status.state is JobState.QUEUED
    assert second_job.status.message == "waiting for 1 CPU in dc-a and 1 CPU in dc-b"

    supervisor.launcher.runners[first.id].state = "succeeded"
    cluster_view.topo = topology(dc_a=2, dc_b=2)
    supervisor.tick()  # first finishes
    supervisor.tick()  # second admitted
    assert store.get_job(second.id).status.state is JobState.PLACING


def test_higher_priority_is_admitted_first(supervisor, store):
    low, _ = supervisor.submit(req("low"), {})
    high, _ = supervisor.submit(req("high", priority=10), {})
    supervisor.tick()
    assert store.get_job(high.id).status.state is JobState.PLACING
    assert store.get_job(low.id).status.state is JobState.QUEUED


def test_cancel_queued_is_immediate_and_cancel_running_waits_for_the_runner(supervisor, store):
    a, _ = supervisor.submit(req("a"), {})
    b, _ = supervisor.submit(req("b"), {})
    assert supervisor.cancel(b.id).status.state is JobState.CANCELLED
    supervisor.tick()
    job = supervisor.cancel(a.id)
    assert job.status.reason == "Cancelling" and supervisor.launcher.runners[a.id].cancelled
    supervisor.launcher.runners[a.id].state = "cancelled"
    supervisor.tick()
    assert store.get_job(a.id).status.state is JobState.CANCELLED


def test_a_lost_runner_is_relaunched_a_bounded_number_of_times_then_the_job_fails_saying_why(supervisor, store):
    job, _ = supervisor.submit(req(), {})
    supervisor.tick()
    for attempt in (1, 2, 3):  # the service's default bound
        del supervisor.launcher.runners[job.id]
        supervisor.tick()  # lost → queued again, then admitted and launched anew on the same tick's next one
        lost = store.get_job(job.id)
        assert (lost.status.state, lost.status.reason, lost.relaunches) == (JobState.QUEUED, "Relaunching", attempt)
        supervisor.tick()
        assert store.get_job(job.id).status.state is JobState.PLACING
        assert [j for j, *_ in supervisor.launcher.launched].count(job.id) == attempt + 1
    events = [e for e in store.list_events(job.id) if e.kind == "runner_relaunched"]
    assert [e.data["attempt"] for e in events] == [1, 2, 3] and all(e.data["max_relaunches"] == 3 for e in events)
    assert supervisor.launcher.swept == []  # the relaunched runner's workers own the job's snapshot folders now
    del supervisor.launcher.runners[job.id]
    supervisor.tick()
    job = store.get_job(job.id)
    assert job.status.state is JobState.FAILED and job.status.reason == "RunnerLost"
    assert "resubmit" in job.status.message and "after 3 relaunch(es)" in job.status.message
    # Its workers went with the runner, which would have removed their snapshots in RAM at the job's end.
    assert supervisor.launcher.swept == [job.id]


def test_training_error_reaches_the_job(supervisor, store):
    job, _ = supervisor.submit(req(), {})
    supervisor.tick()
    r = supervisor.launcher.runners[job.id]
    r.state, r.error = "failed", "RuntimeError: data.source '/x' cannot be read on this node"
    supervisor.tick()
    job = store.get_job(job.id)
    assert job.status.state is JobState.FAILED and job.status.reason == "TrainingError"
    assert "cannot be read" in job.status.message


def test_a_job_below_min_workers_says_it_waits_for_workers_then_trains_again(supervisor, store):
    job, _ = supervisor.submit(req(), {"name": "j"})
    supervisor.tick()
    runner = supervisor.launcher.runners[job.id]
    runner.state = "running"
    supervisor.tick()
    assert store.get_job(job.id).status.reason == "Training"
    runner.wait_reason = "1 worker(s) left after losing 3; the job needs at least 2 (topology.min_workers)"
    supervisor.tick()
    status = store.get_job(job.id).status
    assert (status.state, status.reason, status.message) == (JobState.RUNNING, "WaitingForWorkers", runner.wait_reason)
    runner.wait_reason = ""
    supervisor.tick()
    assert store.get_job(job.id).status.reason == "Training"


def test_a_cancel_is_stored_state_so_a_runner_lost_meanwhile_ends_the_job_cancelled(supervisor, store):
    job, _ = supervisor.submit(req(), {})
    supervisor.tick()
    assert supervisor.cancel(job.id).cancel_requested
    del supervisor.launcher.runners[job.id]  # the runner went away while stopping
    supervisor.tick()
    job = store.get_job(job.id)
    assert job.status.state is JobState.CANCELLED and job.status.reason == "Cancelled"
