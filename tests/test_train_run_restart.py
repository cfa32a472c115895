"""A Ray Train run whose controller failed (not the training) is followed by a new run, at most
``MAX_TRAIN_RUNS`` in all; cancels, the training's own failures and a finished job are never rerun.

Why: in a full test run Ray Train 2.60's controller, while replacing one dead worker's replica group, called the
others, found a second one dead (its node drained a moment later), and ended the run with a controller error it
does not retry, shutting every worker down; the job failed although its survivors' nodes and snapshots lived.
That the new run's workers resume from those snapshots is ``test_elastic_loop``'s
``test_new_workers_resume_from_the_snapshots_of_a_whole_run_that_ended``.
"""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError
from ray.train.v2.api.exceptions import ControllerError

from meridian.service.runner import actor
from meridian.service.runner.actor import MAX_TRAIN_RUNS, JobRunner
from meridian.service.runner.membership import Epoch, Member
from meridian.service.runner.poll import RunnerState
from meridian.workers.contracts.rendezvous import JoinRequest


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(actor, "sweep_snapshots", lambda job_id: [])  # no cluster here
    plan = type("P", (), {"rank_datacenters": ("dc-a", "dc-b")})()
    r = JobRunner("j1", {}, plan, "/tmp/unused")
    r.probed = 0

    def probe_members():
        r.probed += 1
        return {"w0"}

    monkeypatch.setattr(r.coordinator, "probe_members", probe_members)
    return r


def _runs(runner, outcomes):
    """Run the runner's loop over ``outcomes``, one per Train run; the attempts made."""
    attempts = []

    def fit(attempt):
        attempts.append(attempt)
        outcome = outcomes[len(attempts) - 1]
        return outcome() if callable(outcome) else outcome

    runner._fit = fit
    runner._run()
    return attempts


def member(wid):
    request = JoinRequest(worker_id=wid, datacenter="dc-a", node_id="n", address="127.0.0.1", port=1)
    return Member.from_request(request, joined_at=0.0)


def _controller_error():
    return ControllerError(RuntimeError("The actor died unexpectedly before finishing this task."))


def test_a_controller_failure_is_followed_by_a_new_run(runner):
    def the_new_run_trains_to_the_end():
        runner.coordinator.state.epoch = Epoch(2, (member("w9"),), resume_step=10)
        runner.coordinator.finished.add("w9")  # what the last worker's finish call does
        return None

    assert _runs(runner, [_controller_error(), the_new_run_trains_to_the_end]) == [1, 2]
    assert runner.poll(0).state is RunnerState.SUCCEEDED and runner.probed == 1
    events = [e for e in runner.poll(0).events if e.kind == "train_run_restarted"]
    assert len(events) == 1 and "starting Train run 2" in events[0].message


def test_runs_stop_after_the_limit_and_the_job_fails_with_the_last_error(runner):
    assert _runs(runner, [_controller_error()] * MAX_TRAIN_RUNS) == list(range(1, MAX_TRAIN_RUNS + 1))
    poll = runner.poll(0)
    assert poll.state is RunnerState.FAILED and "actor died" in poll.error


@pytest.mark.parametrize("why", ["cancelled", "training failed", "process died"])
def test_other_ends_are_not_rerun(runner, why):
    error = _controller_error()
    if why == "cancelled":
        runner.cancel()
    elif why == "training failed":
        runner.fail("RuntimeError: training failed: OSError: disk full")  # a worker's own error ends the job
    else:
        error = RayActorError()  # the controller's process died: its workers may still train
    assert _runs(runner, [error, None]) == [1]
    assert runner.probed == 0
