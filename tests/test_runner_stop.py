"""Stopping a run: Ray Train's controller is asked to abort once, and killed if its event loop never gets to it.

Why: in ``bench recovery`` the cancel of a job whose node had died and come back waited behind Ray Train's own
replacement of the dead worker (a blocking ``ray.get`` on the controller's event loop), and the job had not ended
60 s after the cancel; the service repeated its cancel meanwhile, and each call held a runner thread for 30 s.
"""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from meridian.service.runner import actor
from meridian.service.runner.actor import JobRunner


class Controller:
    """A controller handle: ``abort.remote()`` returns a reference this test's ``ray.get`` resolves."""

    def __init__(self, stuck: bool) -> None:
        self.stuck, self.aborts = stuck, 0
        self.abort = self

    def remote(self):
        self.aborts += 1
        return self


@pytest.fixture
def runner(monkeypatch):
    plan = type("P", (), {"rank_datacenters": ("dc-a", "dc-b")})()
    r = JobRunner("j1", {}, plan, "/tmp/unused")
    r.killed, r.waits = [], []

    def get(ref, timeout=None):
        r.waits.append(timeout)
        if ref.stuck:
            raise GetTimeoutError("the controller's loop is busy")
        raise RayActorError()  # abort() ends the controller's process: the call "fails"

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: r.killed.append(handle))
    monkeypatch.setattr(r, "_members_gone", lambda: True)
    return r


def test_a_controller_that_aborts_is_not_killed(runner):
    c = Controller(stuck=False)
    runner.set_controller(c)
    runner.cancel()
    assert c.aborts == 1 and runner.killed == []
    assert not [e for e in runner.poll(0).events if e["kind"] == "train_controller_killed"]


def test_a_controller_that_never_gets_to_its_abort_is_killed_after_the_wait(runner):
    c = Controller(stuck=True)
    runner.set_controller(c)
    runner.cancel()
    assert runner.waits == [actor.ABORT_WAIT_S] and runner.killed == [c]
    (event,) = [e for e in runner.poll(0).events if e["kind"] == "train_controller_killed"]
    assert "did not abort within" in event["message"]


def test_a_repeated_cancel_does_not_wait_again(runner):
    c = Controller(stuck=True)
    runner.set_controller(c)
    for _ in range(4):  # the service repeats its cancel until the job ends
        runner.cancel()
    assert c.aborts == 1 and runner.killed == [c]
    second = Controller(stuck=False)  # a new Train run's controller is stopped too
    runner.set_controller(second)
    assert second.aborts == 1
