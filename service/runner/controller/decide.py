"""The runner's decisions, apart from doing them: :func:`decide` takes the controller's state and one
observation and returns the next state and the actions for the runner to carry out, in order (after Ray Train
V2's controller loop and failure policy). Pure: no Ray, no threads, no clock (observations carry the time);
tested one observation at a time (tests/test_runner_controller.py).

Rules:
- The first outcome wins: a worker's failure, a cancel, the last step or the run's own end, whichever the
  runner sees first; later ones change nothing.
- A run that ends because Ray Train's controller failed (its own error, not the training's) is followed by a
  new run, up to :data:`MAX_TRAIN_RUNS`, unless the job finished meanwhile.
- After the last step the run may take :data:`FIT_GRACE_S` to end by itself (a job with trackers, as long again as
  rank 0 may take to close them); a run whose controller does not answer cannot, and is ended at once.
- The outcome is told only after the job's in-memory snapshots were swept (the service kills the runner then).
- A suspension (preemption) ends the job's run once every member wrote its part of the checkpoint; a cancel or a
  failure before that wins as usual, and a job that finishes meanwhile succeeds.
- The liveness verdicts (:mod:`meridian.service.runner.liveness.judge`) are acted on while the job trains: a dead
  worker is left behind (the epoch re-forms without it), a stuck member's training process is stopped (its next
  one rejoins from the snapshots), a rank that went silent is named as a stall, a slow one as ``rank_slow``. Once
  the job is ending nothing is stopped or re-formed for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from meridian.service.runner.controller.state import (
    Cancelled,
    ControllerState,
    Ended,
    Ending,
    Failed,
    Outcome,
    Succeeded,
    Suspended,
    Training,
)
from meridian.service.runner.liveness.judge import Liveness, Verdict
from meridian.workers.contracts.tracking import CLOSE_TIMEOUT_S, TrackingConfig

MAX_TRAIN_RUNS = 3
"""Ray Train runs one job may go through: a run whose controller failed (not the training) is followed by a
new one, whose workers take over the snapshots the ended ones left on their nodes."""
FIT_GRACE_S = 10.0
"""After the last step, how long the Train run may take to return by itself before the runner ends it."""


def fit_grace_s(tracking: TrackingConfig | None) -> float:
    """:data:`FIT_GRACE_S`, and for a job with trackers as long again as rank 0 may wait for them to close
    (:data:`~meridian.workers.contracts.tracking.CLOSE_TIMEOUT_S`): ending its run sooner can lose their last
    records (seen: a TensorBoard file without its losses, the job's runner having ended rank 0 while W&B opened)."""
    return FIT_GRACE_S + (CLOSE_TIMEOUT_S if tracking is not None and tracking.enabled else 0.0)


# -- observations ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stepped:
    """A step record arrived."""


@dataclass(frozen=True)
class CancelAsked:
    pass


@dataclass(frozen=True)
class SuspendAsked:
    """Preempt the job: checkpoint at the next step boundary and stop."""


@dataclass(frozen=True)
class SuspendWritten:
    """Every member of the suspend epoch wrote its part of the checkpoint of ``step``."""

    step: int


@dataclass(frozen=True)
class WorkerFailed:
    """A worker hit an error that restarting cannot fix (:meth:`JobRunner.fail`)."""

    error: str


@dataclass(frozen=True)
class RunEnded:
    """The Train run ``attempt`` returned (``error`` empty: cleanly)."""

    attempt: int
    error: str = ""
    controller_failed: bool = False
    """It ended because Ray Train's control loop raised an error it does not retry (by type: ``ControllerError``)."""
    job_finished: bool = False
    """A member of the current epoch trained the last step."""
    suspended_at: int | None = None
    """The members wrote the suspend checkpoint of this step (its workers end cleanly then)."""


@dataclass(frozen=True)
class LastStepSeen:
    """The runner's watch saw the last step done and the workers' result arrived."""

    now: float
    run_answers: bool = True
    """Ray Train's controller answered a cheap call (its event loop is not held)."""
    grace_s: float = FIT_GRACE_S
    """How long after the first of these the run may take to end by itself: :data:`FIT_GRACE_S`, plus the time
    rank 0 may take to close the job's trackers (it sends its result after; another worker's can arrive first)."""


@dataclass(frozen=True)
class ControllerStarted:
    """A Train run's controller handed the runner its handle."""


@dataclass(frozen=True)
class RanksJudged:
    """The liveness judge's verdicts that were not acted on before (:class:`~meridian.service.runner.liveness.watch.LivenessWatch`)."""

    verdicts: tuple[Verdict, ...]


Observation = (Stepped | CancelAsked | WorkerFailed | RunEnded | LastStepSeen | ControllerStarted | SuspendAsked
               | SuspendWritten | RanksJudged)


# -- actions ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StopTraining:
    """End the Train run and the replacement workers (idempotent per run); no epoch forms after."""


@dataclass(frozen=True)
class Suspend:
    """Tell the coordinator: members leave at their next step boundary, checkpoint and stop."""


@dataclass(frozen=True)
class StartRun:
    """Start Train run ``attempt``: its workers take over the snapshots the ended run left on their nodes."""

    attempt: int
    after_error: str


@dataclass(frozen=True)
class Finish:
    """Sweep the job's snapshots, then tell the service ``outcome``."""

    outcome: Outcome


@dataclass(frozen=True)
class LeaveBehind:
    """Dead workers: not waited for; the epoch re-forms without them (a waiting one is dropped)."""

    verdicts: tuple[Verdict, ...]


@dataclass(frozen=True)
class StopStuck:
    """Stuck members: their agents stop the training process of the verdicts' epoch."""

    verdicts: tuple[Verdict, ...]


@dataclass(frozen=True)
class NameRanks:
    """Name ranks in the job's events: a silent one as a ``stall``, a slow one as ``rank_slow``."""

    verdicts: tuple[Verdict, ...]


Action = StopTraining | StartRun | Finish | Suspend | LeaveBehind | StopStuck | NameRanks
LivenessAction = LeaveBehind | StopStuck | NameRanks


def liveness_actions(verdicts: Sequence[Verdict]) -> tuple[LivenessAction, ...]:
    """What to do about ``verdicts`` while the job trains: the dead first (not waiting for them may form the
    epoch at once), then the stuck, then what is only named."""
    dead = tuple(v for v in verdicts if v.liveness is Liveness.DEAD)
    stuck = tuple(v for v in verdicts if v.liveness is Liveness.STUCK and v.cause.stops_the_process)
    named = tuple(v for v in verdicts if v.liveness is Liveness.SLOW
                  or (v.liveness is Liveness.STUCK and not v.cause.stops_the_process))
    return tuple(a for a in (LeaveBehind(dead), StopStuck(stuck), NameRanks(named)) if a.verdicts)


def decide(state: ControllerState, obs: Observation) -> tuple[ControllerState, tuple[Action, ...]]:
    """The state after ``obs`` and what the runner does about it, in order."""
    if isinstance(state, Ended):
        # The job is over; a repeated cancel, or a controller of a run that still starts, is stopped again.
        return state, (StopTraining(),) if isinstance(obs, (CancelAsked, ControllerStarted)) else ()
    if isinstance(state, Ending):
        return _ending(state, obs)
    return _training(state, obs)


def _training(state: Training, obs: Observation) -> tuple[ControllerState, tuple[Action, ...]]:
    if isinstance(obs, Stepped):
        return (replace(state, stepped=True) if not state.stepped else state), ()
    if isinstance(obs, CancelAsked):
        return Ending(outcome=Cancelled(), stepped=state.stepped), (StopTraining(),)
    if isinstance(obs, WorkerFailed):
        # The others are stopped first: their processes restart when their collectives fail and make their snapshot
        # folders again, which a sweep before the stop left in RAM.
        outcome = Failed(error=obs.error)
        return Ended(outcome=outcome, stepped=state.stepped), (StopTraining(), Finish(outcome))
    if isinstance(obs, ControllerStarted):
        return state, ()
    if isinstance(obs, RanksJudged):
        return state, liveness_actions(obs.verdicts)
    if isinstance(obs, SuspendAsked):
        return (replace(state, suspending=True), (Suspend(),)) if not state.suspending else (state, ())
    if isinstance(obs, SuspendWritten):
        if not state.suspending:
            return state, ()
        outcome = Suspended(step=obs.step)
        return Ended(outcome=outcome, stepped=state.stepped), (StopTraining(), Finish(outcome))
    if isinstance(obs, LastStepSeen):
        if state.last_step_at is None:
            state = replace(state, last_step_at=obs.now, run_cannot_end=not obs.run_answers)
        if state.run_cannot_end or obs.now - state.last_step_at > obs.grace_s:
            return Ended(outcome=Succeeded(), stepped=state.stepped), (Finish(Succeeded()), StopTraining())
        return state, ()
    assert isinstance(obs, RunEnded)
    if obs.attempt != state.attempt:
        return state, ()  # a run already replaced
    if obs.error and obs.controller_failed and not obs.job_finished and state.attempt < MAX_TRAIN_RUNS:
        return replace(state, attempt=state.attempt + 1), (StartRun(state.attempt + 1, after_error=obs.error),)
    outcome: Outcome
    if obs.error:
        outcome = Failed(error=obs.error)
    elif state.suspending and obs.suspended_at is not None:
        outcome = Suspended(step=obs.suspended_at)
    elif obs.job_finished:
        outcome = Succeeded()
    else:
        outcome = Failed(error="every worker ended before the job's last step (see the job's events)")
    return Ended(outcome=outcome, stepped=state.stepped), (Finish(outcome),)


def _ending(state: Ending, obs: Observation) -> tuple[ControllerState, tuple[Action, ...]]:
    if isinstance(obs, RunEnded):
        return Ended(outcome=state.outcome, stepped=state.stepped), (Finish(state.outcome),)
    if isinstance(obs, (CancelAsked, ControllerStarted)):
        return state, (StopTraining(),)  # stop the run again: a new controller, or the service's repeated cancel
    if isinstance(obs, Stepped):
        return replace(state, stepped=True), ()
    return state, ()
