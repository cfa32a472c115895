"""Stopping a run: Ray Train's controller is asked to abort once, and killed if its event loop never gets to it (at
once when it does not even answer a call for its state, once the run's workers have started).

Why: in ``bench recovery`` the cancel of a job whose node had died and come back waited behind Ray Train's own
replacement of the dead worker (a blocking ``ray.get`` on the controller's event loop), and the job had not ended
60 s after the cancel; the service repeated its cancel meanwhile, and each call held a runner thread for 30 s.
"""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from meridian.service.runner import actor, replacements, train_run
from meridian.service.runner.actor import JobRunner
from meridian.workers.contracts.rendezvous import JoinRequest


class Controller:
    """A controller handle: ``abort.remote()`` and ``get_state.remote()`` return references this test's ``ray.get``
    resolves. ``held``: its event loop answers no call; ``abort_hangs``: it answers, but never gets to its abort."""

    def __init__(self, held: bool = False, abort_hangs: bool = False) -> None:
        self.held, self.abort_hangs, self.calls = held, abort_hangs, []
        self.abort, self.get_state = Method(self, "abort"), Method(self, "get_state")
        self._actor_id = bytes.fromhex("c0ffee")  # a handle's id (ray.actor.ActorHandle._actor_id)


class Method:
    def __init__(self, controller: Controller, name: str) -> None:
        self.controller, self.name = controller, name

    def remote(self):
        self.controller.calls.append(self.name)
        return self


@pytest.fixture
def runner(monkeypatch):
    plan = type("P", (), {"rank_datacenters": ("dc-a", "dc-b")})()
    r = JobRunner("j1", {}, plan, "/tmp/unused")
    r.killed, r.waits = [], []

    def get(ref, timeout=None):
        r.waits.append((ref.name, timeout))
        c = ref.controller
        if c.held or (ref.name == "abort" and c.abort_hangs):
            raise GetTimeoutError("the controller's loop is busy")
        if ref.name == "abort":
            raise RayActorError()  # abort() ends the controller's process: the call "fails"
        return "RunningState"

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: r.killed.append(handle))
    monkeypatch.setattr(r, "_members_gone", lambda: True)
    monkeypatch.setattr(r.coordinator, "join", lambda request, known_epoch: None)
    r.pg_cleanups = []
    monkeypatch.setattr(train_run, "remove_placement_groups_of", lambda actor_id: r.pg_cleanups.append(actor_id) or ["pg1"])
    return r


def started(runner, controller, worker_id="train-worker-1"):
    """``controller``'s run, whose workers have started their train function: one of them joins."""
    runner.set_controller(controller)
    runner.rdzv_join(JoinRequest(worker_id=worker_id, datacenter="dc-a", node_id="n1", address="127.0.0.1",
                                 port=29500), 0)


def killed_events(runner):
    return [e for e in runner.poll(0).events if e.kind == "train_controller_killed"]


def test_a_controller_that_answers_is_asked_to_abort_and_not_killed(runner):
    c = Controller()
    started(runner, c)
    runner.cancel()
    assert c.calls == ["get_state", "abort"] and runner.killed == []
    assert runner.waits == [("get_state", train_run.ANSWER_WAIT_S), ("abort", train_run.ABORT_WAIT_S)]
    assert not killed_events(runner)


def test_a_held_controller_is_killed_after_the_short_wait_without_an_abort(runner):
    # Its event loop is held (Ray Train's replacement of a worker the cluster has no room for): asking it to abort
    # would wait ABORT_WAIT_S for nothing. Seen in bench recovery: every cancel after a scale-up took 10.2-10.5 s.
    c = Controller(held=True)
    started(runner, c)
    runner.cancel()
    assert c.calls == ["get_state"] and runner.killed == [c]
    assert runner.waits == [("get_state", train_run.ANSWER_WAIT_S)]
    (event,) = killed_events(runner)
    assert "did not answer within" in event.message and event.data["waited_s"] == train_run.ANSWER_WAIT_S
    # the placement groups it made are removed (those its workers run in, if Ray Train's cleaner has not yet)
    assert runner.pg_cleanups == ["c0ffee"] and event.data["placement_groups_removed"] == ["pg1"]


def test_a_controller_that_answers_but_never_gets_to_its_abort_is_killed_after_the_wait(runner):
    c = Controller(abort_hangs=True)
    started(runner, c)
    runner.cancel()
    assert runner.waits[-1] == ("abort", train_run.ABORT_WAIT_S) and runner.killed == [c]
    (event,) = killed_events(runner)
    assert "did not abort within" in event.message and runner.pg_cleanups == ["c0ffee"]


def test_a_repeated_cancel_does_not_wait_again(runner):
    c = Controller(held=True)
    started(runner, c)
    for _ in range(4):  # the service repeats its cancel until the job ends
        runner.cancel()
    assert c.calls == ["get_state"] and runner.killed == [c]
    second = Controller()  # a new Train run's controller is stopped too (its workers have not started: no ping)
    runner.set_controller(second)
    assert second.calls == ["abort"]


def test_a_controller_placing_its_workers_is_asked_to_abort_however_busy(runner):
    # Placing the run's workers keeps the controller's loop busy for seconds without holding it, and its abort is
    # Ray Train's clean end (a fast kill there failed test_service_ray's cancel while placing: 0 of 4 CPUs free 30 s
    # later, the placement group left behind). So no fast kill before a worker of the run joined; a worker the
    # runner started itself (a replacement) does not count as the run's.
    c = Controller(held=True)
    runner.set_controller(c)
    runner._replacements._started["replacement-1"] = ("dc-a", object())
    runner.rdzv_join(JoinRequest(worker_id="replacement-1", datacenter="dc-a", node_id="n2", address="127.0.0.1",
                                 port=29501), 0)
    runner.cancel()
    assert c.calls == ["abort"] and runner.waits == [("abort", train_run.ABORT_WAIT_S)] and runner.killed[0] is c
    (event,) = killed_events(runner)
    assert "did not abort within" in event.message and runner.pg_cleanups == ["c0ffee"]


def test_a_sweep_that_raises_does_not_keep_the_job_from_its_outcome(monkeypatch):
    # Before: the first _finish set _finishing, the sweep raised (a busy GCS), the outcome was never set, and every
    # later _finish returned at once: the job stayed running for ever.
    from meridian.service.runner.membership import Epoch, Member
    from meridian.service.runner.poll import RunnerState

    def busy(job_id):
        raise RuntimeError("GCS unavailable: ray.nodes() timed out")

    monkeypatch.setattr(actor, "sweep_snapshots", busy)
    plan = type("P", (), {"rank_datacenters": ("dc-a",)})()
    r = JobRunner("j1", {}, plan, "/tmp/unused")
    m = Member.from_request(JoinRequest(worker_id="w0", datacenter="dc-a", node_id="n", address="127.0.0.1", port=1),
                            joined_at=0.0)

    def fit(attempt):  # trains to the last step
        r.coordinator.state.epoch = Epoch(1, (m,), resume_step=0)
        r.coordinator.finished.add("w0")

    monkeypatch.setattr(r, "_fit", fit)
    r._run()
    poll = r.poll(0)
    assert r._done.is_set() and poll.state is RunnerState.SUCCEEDED
    assert "snapshots_not_swept" in [e.kind for e in poll.events]


def test_no_replacement_worker_is_started_once_the_job_is_cancelled(monkeypatch):
    from meridian.service.cluster.topology import ClusterTopology, NodeInfo
    from meridian.service.runner.membership import Epoch, Member

    started, killed = [], []

    class FakeActor:
        def __init__(self, n):
            self._actor_id = bytes([n])

    def start(name, cfg, dc, plan):
        started.append(FakeActor(len(started)))
        return dc, started[-1]

    monkeypatch.setattr(replacements, "_start_replacement", start)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    plan = type("P", (), {"rank_datacenters": ("dc-a", "dc-a"), "resources_per_worker": {"CPU": 1.0}})()
    r = JobRunner("j1", {}, plan, "/tmp/unused")
    monkeypatch.setattr(r._stopper, "stop", lambda controller: None)
    m = Member.from_request(JoinRequest(worker_id="w0", datacenter="dc-a", node_id="n1", address="127.0.0.1", port=1),
                            joined_at=0.0)
    r.coordinator.state.epoch = Epoch(2, (m,), resume_step=10)  # dc-a lost its second worker earlier
    node = NodeInfo("n1", "dc-a", True, "", False, 2.0, 0.0, 0.0, available_cpus=1.0, available_gpus=0.0, labels={})
    topo = ClusterTopology((node,))
    r.cancel()  # the coordinator closes, the controller is stopped; fit() has not returned, so the job is not done
    r._replacements.replace_lost(topo, r.coordinator)  # the watch's next tick: dc-a has room again
    # Before: a worker was started after cancel's kill loop had run, held its CPU, and no one killed it.
    assert started == [] and "worker_replacing" not in [e.kind for e in r.poll(0).events]


def test_a_replacement_whose_start_a_cancel_overtook_is_killed(monkeypatch):
    from meridian.service.cluster.topology import ClusterTopology, NodeInfo
    from meridian.service.runner.membership import Epoch, Member

    killed = []
    plan = type("P", (), {"rank_datacenters": ("dc-a", "dc-a"), "resources_per_worker": {"CPU": 1.0}})()
    r = JobRunner("j1", {}, plan, "/tmp/unused")
    monkeypatch.setattr(r._stopper, "stop", lambda controller: None)
    handle = type("A", (), {"_actor_id": b"\x07"})()

    def start(name, cfg, dc, plan):
        r.cancel()  # lands while Ray starts the worker: cancel's kill loop runs before the runner knows of it
        return dc, handle

    monkeypatch.setattr(replacements, "_start_replacement", start)
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: killed.append(h))
    m = Member.from_request(JoinRequest(worker_id="w0", datacenter="dc-a", node_id="n1", address="127.0.0.1", port=1),
                            joined_at=0.0)
    r.coordinator.state.epoch = Epoch(2, (m,), resume_step=10)
    node = NodeInfo("n1", "dc-a", True, "", False, 2.0, 0.0, 0.0, available_cpus=1.0, available_gpus=0.0, labels={})
    r._replacements.replace_lost(ClusterTopology((node,)), r.coordinator)
    assert killed == [handle]
