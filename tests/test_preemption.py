"""Priority preemption, stepped without Ray: a job of higher priority that cannot fit suspends running jobs of
lower priority (each writes a durable checkpoint at its next step boundary and goes back to the queue), and a
suspended job is launched again with the plan and config it was given at submit, to resume from that checkpoint.
That it then ends with the loss of an uninterrupted run is tests/test_preemption_ray.py's."""

from __future__ import annotations

from dataclasses import replace

from fakes import join_concurrently, submit, topology

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.jobs import JobState
from meridian.service.runner.controller.decide import (
    CancelAsked,
    Finish,
    RunEnded,
    StopTraining,
    Suspend,
    SuspendAsked,
    SuspendWritten,
    decide,
)
from meridian.service.runner.controller.state import Ended, Ending, Suspended, Training, runner_state
from meridian.service.runner.coordinator import Coordinator
from meridian.service.runner.poll import RunnerState
from meridian.service.supervision.preemption import Running, victims
from meridian.workers.contracts.rendezvous import Assignment, JoinRequest


def busy(topo: ClusterTopology) -> ClusterTopology:
    return ClusterTopology(tuple(replace(n, available_cpus=0.0) for n in topo.nodes))


def test_victims_are_the_fewest_lowest_priority_newest_jobs_that_make_room(supervisor):
    topo = topology(dc_a=2, dc_b=2)
    from fakes import spec as _spec

    from meridian.api.schemas import JobSpec

    request = JobSpec.model_validate(_spec()).to_request("")
    four = supervisor.plan(request, topo)  # 4 workers, one per node
    two = supervisor.plan(replace(request, topology=replace(request.topology, workers_per_datacenter=1)), topo)
    nodes = tuple(n.node_id for n in topo.nodes if n.datacenter)
    half_a, half_b = (nodes[0], nodes[2]), (nodes[1], nodes[3])
    old = Running(job_id="old", priority=0, seq=1, plan=two, nodes=half_a, suspendable=True)
    new = Running(job_id="new", priority=0, seq=2, plan=two, nodes=half_b, suspendable=True)
    full = busy(topo)
    assert [v.job_id for v in victims(two, 10, [old, new], full)] == ["new"]  # the newest of the lowest first
    assert [v.job_id for v in victims(four, 10, [old, new], full)] == ["new", "old"]
    assert victims(two, 0, [old, new], full) is None  # the same priority never preempts
    assert victims(two, 10, [replace(old, suspendable=False), replace(new, suspendable=False)], full) is None
    assert victims(two, 10, [old, replace(new, suspending=True)], full) == []  # a suspension under way makes room
    higher = Running(job_id="vip", priority=20, seq=3, plan=two, nodes=half_b, suspendable=True)
    assert [v.job_id for v in victims(two, 10, [old, higher], full)] == ["old"]


def test_the_controller_suspends_once_its_members_wrote_the_checkpoint_and_a_cancel_still_wins():
    state, actions = decide(Training(stepped=True), SuspendAsked())
    assert state == Training(stepped=True, suspending=True) and actions == (Suspend(),)
    assert decide(state, SuspendAsked()) == (state, ())  # asked again each tick: the same
    done, actions = decide(state, SuspendWritten(step=7))
    assert done == Ended(outcome=Suspended(step=7), stepped=True)
    assert actions == (StopTraining(), Finish(Suspended(step=7)))
    assert runner_state(done, told=True) is RunnerState.SUSPENDED
    # The run's workers end cleanly after writing: that too is the suspension, if the watch has not seen it yet.
    assert decide(state, RunEnded(attempt=1, suspended_at=7))[0] == done
    cancelled, _ = decide(state, CancelAsked())
    assert isinstance(cancelled, Ending) and decide(cancelled, SuspendWritten(step=7))[0] == cancelled


def test_the_coordinator_forms_a_suspend_epoch_at_the_next_step_boundary():
    c = Coordinator(planned_workers=2, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: None)
    members = [JoinRequest(worker_id=f"w{i}", datacenter="dc-a", node_id=f"n{i}", address="127.0.0.1",
                           port=29600 + i) for i in range(2)]
    threads, first = join_concurrently(c, members)
    for t in threads:
        t.join(10)
    assert not c.pending_change(1) and c.suspended_at is None
    c.suspend()
    assert c.pending_change(1)  # rank 0 leaves at the next step boundary
    back = [replace(m, last_step=5) for m in members]
    threads, again = join_concurrently(c, back, known_epoch=1)
    for t in threads:
        t.join(10)
    a: Assignment = again["w0"]
    assert a.suspend and a.epoch == 2 and a.resume_step == 5 and not first["w0"].suspend
    c.suspended("w0", 5)
    assert c.suspended_at is None  # every member's part is needed
    c.suspended("w1", 5)
    assert c.suspended_at == 5


def test_a_higher_priority_job_suspends_a_lower_one_which_resumes_with_its_own_config(supervisor, store, cluster_view):
    launcher = supervisor.launcher
    low = submit(supervisor, name="low", priority=0)  # four workers: the whole cluster
    supervisor.tick()
    runner = launcher.runners[low]
    nodes = [n for n in cluster_view.topo.nodes if n.datacenter]
    runner.push("event", {"kind": "epoch_formed", "message": "epoch 1", "data": {
        "epoch": 1, "datacenters": [n.datacenter for n in nodes], "resume_step": 0,
        "placement": [{"rank": r, "worker_id": f"w{r}", "node_id": n.node_id, "datacenter": n.datacenter}
                      for r, n in enumerate(nodes)]}})
    runner.state = "running"
    supervisor.tick()
    assert store.get_job(low).status.state is JobState.RUNNING and len(store.get_job(low).placement) == 4
    cluster_view.topo = busy(cluster_view.topo)  # its workers hold every CPU

    high = submit(supervisor, name="high", priority=10, topology={"workers_per_datacenter": 1})
    supervisor.tick()
    waiting, being_suspended = store.get_job(high), store.get_job(low)
    assert waiting.status.reason == "WaitingForCapacity" and f"suspending lower-priority job(s) {low}" in waiting.status.message
    assert being_suspended.suspend_requested and being_suspended.status.reason == "Preempting"
    assert set(launcher.suspends) == {low} and runner.suspending  # asked at admission, and by every poll after
    assert [e.data for e in store.list_events(low) if e.kind == "preempted"] == [{"by_job": high, "by_priority": 10}]
    supervisor.tick()  # asked again until it is done; nothing else is suspended
    assert set(launcher.suspends) == {low} and store.get_job(high).status.state is JobState.QUEUED

    runner.state, runner.suspended_step = "suspended", 7
    supervisor.tick()
    suspended = store.get_job(low)
    assert (suspended.status.state, suspended.status.reason) == (JobState.QUEUED, "Preempted")
    assert "checkpoint of step 7" in suspended.status.message and not suspended.suspend_requested
    assert suspended.progress["cursor"] == 0 and suspended.placement == []  # the next runner reports from 0
    assert low in launcher.released
    cluster_view.topo = topology(dc_a=2, dc_b=2)  # its workers are gone
    supervisor.tick()
    assert store.get_job(high).status.state is JobState.PLACING  # the higher priority goes first
    supervisor.tick()
    assert store.get_job(low).status.reason == "Preempted"  # while it waits it still says where it resumes from
    launcher.runners[high].state = "succeeded"
    supervisor.tick()
    supervisor.tick()
    assert store.get_job(low).status.state is JobState.PLACING  # capacity returned: it is launched again
    first, again = [(config, plan) for job_id, config, plan in launcher.launched if job_id == low]
    assert again == first == (suspended.resolved.config, suspended.resolved.plan)
