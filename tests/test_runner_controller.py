"""The runner's controller, stepped one observation at a time without Ray (as Ray Train V2's
``tests/test_controller.py`` steps its controller against fakes): each rule of
:mod:`meridian.service.runner.controller.decide` is one sequence of observations here."""

from __future__ import annotations

from meridian.service.runner.controller.decide import (
    FIT_GRACE_S,
    MAX_TRAIN_RUNS,
    CancelAsked,
    ControllerStarted,
    Finish,
    LastStepSeen,
    RunEnded,
    StartRun,
    Stepped,
    StopTraining,
    WorkerFailed,
    decide,
    fit_grace_s,
)
from meridian.service.runner.controller.state import (
    Cancelled,
    Ended,
    Ending,
    Failed,
    Succeeded,
    Training,
    error_of,
    runner_state,
)
from meridian.service.runner.poll import RunnerState


def steps(*observations, state=None):
    """Feed ``observations`` in order; the final state and every action taken, in order."""
    state = state or Training()
    taken = []
    for obs in observations:
        state, actions = decide(state, obs)
        taken += actions
    return state, taken


def test_a_run_that_trains_to_the_end_succeeds_and_is_told_only_once_swept():
    state, actions = steps(Stepped(), RunEnded(attempt=1, job_finished=True))
    assert state == Ended(outcome=Succeeded(), stepped=True) and actions == [Finish(Succeeded())]
    assert runner_state(state, told=False) is RunnerState.RUNNING  # the sweep has not finished
    assert runner_state(state, told=True) is RunnerState.SUCCEEDED
    assert runner_state(Training(), told=False) is RunnerState.STARTING


def test_a_cancel_stops_training_and_ends_cancelled_when_the_run_returns():
    state, actions = steps(Stepped(), CancelAsked())
    assert isinstance(state, Ending) and state.outcome == Cancelled() and actions == [StopTraining()]
    # The service repeats its cancel; a new run's controller starts meanwhile: each is stopped again.
    state, actions = steps(CancelAsked(), ControllerStarted(), state=state)
    assert actions == [StopTraining(), StopTraining()]
    state, actions = steps(RunEnded(attempt=1, error="aborted"), state=state)
    assert state == Ended(outcome=Cancelled(), stepped=True) and actions == [Finish(Cancelled())]
    assert runner_state(state, told=True) is RunnerState.CANCELLED


def test_a_worker_failure_stops_the_others_before_the_sweep_and_its_error_wins():
    state, actions = steps(WorkerFailed(error="OSError: No space left on device"))
    assert actions == [StopTraining(), Finish(Failed(error="OSError: No space left on device"))]
    # The aborted run's own end, and a cancel after it, change nothing.
    state, actions = steps(RunEnded(attempt=1, error="the run was aborted"), CancelAsked(), state=state)
    assert actions == [StopTraining()] and error_of(state, told=True) == "OSError: No space left on device"


def test_a_failed_train_controller_is_followed_by_new_runs_up_to_the_limit():
    state, actions = steps(RunEnded(attempt=1, error="controller died", controller_failed=True))
    assert state == Training(attempt=2) and actions == [StartRun(2, after_error="controller died")]
    failures = [RunEnded(attempt=a, error="controller died", controller_failed=True) for a in range(2, MAX_TRAIN_RUNS + 1)]
    state, actions = steps(*failures, state=state)
    assert state == Ended(outcome=Failed(error="controller died")) and actions[-1] == Finish(Failed(error="controller died"))
    assert [a.attempt for a in actions if isinstance(a, StartRun)] == list(range(3, MAX_TRAIN_RUNS + 1))


def test_a_training_error_or_a_finished_job_is_never_run_again():
    state, _ = steps(RunEnded(attempt=1, error="ValueError: bad data"))
    assert state == Ended(outcome=Failed(error="ValueError: bad data"))
    state, _ = steps(RunEnded(attempt=1, error="controller died", controller_failed=True, job_finished=True))
    assert isinstance(state, Ended) and state.outcome == Failed(error="controller died")
    state, _ = steps(RunEnded(attempt=1))  # clean, but no member trained the last step
    assert isinstance(state.outcome, Failed) and "before the job's last step" in state.outcome.error
    assert steps(RunEnded(attempt=7))[0] == Training()  # a run already replaced: ignored


def test_after_the_last_step_the_run_gets_a_grace_to_end_unless_its_controller_is_held():
    state, actions = steps(LastStepSeen(now=100.0), LastStepSeen(now=100.0 + FIT_GRACE_S))
    assert isinstance(state, Training) and state.last_step_at == 100.0 and actions == []
    state, actions = steps(LastStepSeen(now=100.0 + FIT_GRACE_S + 0.1), state=state)
    assert state == Ended(outcome=Succeeded()) and actions == [Finish(Succeeded()), StopTraining()]
    # A controller that does not answer cannot end its run: the job ends at once.
    state, actions = steps(Stepped(), LastStepSeen(now=5.0, run_answers=False))
    assert state == Ended(outcome=Succeeded(), stepped=True) and actions[0] == Finish(Succeeded())
    # The run returning by itself later changes nothing.
    assert steps(RunEnded(attempt=1, job_finished=True), state=state)[1] == []


def test_a_job_with_trackers_gives_rank_0_the_time_to_close_them_before_its_run_is_ended():
    from meridian.workers.contracts.tracking import CLOSE_TIMEOUT_S, TrackingConfig

    assert fit_grace_s(None) == fit_grace_s(TrackingConfig()) == FIT_GRACE_S  # no tracker asked for
    grace = fit_grace_s(TrackingConfig(tensorboard=True))
    assert grace == FIT_GRACE_S + CLOSE_TIMEOUT_S
    # another worker's result came first; rank 0 is still closing its trackers when FIT_GRACE_S is over
    state, actions = steps(LastStepSeen(now=100.0, grace_s=grace), LastStepSeen(now=100.0 + FIT_GRACE_S + 1, grace_s=grace))
    assert isinstance(state, Training) and actions == []
    state, actions = steps(LastStepSeen(now=100.0 + grace + 0.1, grace_s=grace), state=state)
    assert state == Ended(outcome=Succeeded()) and actions == [Finish(Succeeded()), StopTraining()]
