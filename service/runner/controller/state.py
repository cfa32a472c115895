"""Where a job's runner is in its life, as one value whose type is the state and whose fields are its payload
(after Ray Train V2's ``_internal/execution/controller/state.py``): :class:`Training` → :class:`Ending` →
:class:`Ended`. Only :func:`~meridian.service.runner.controller.decide.decide` makes a new one. Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

from meridian.service.runner.poll import RunnerState


@dataclass(frozen=True, kw_only=True)
class Succeeded:
    """Every member trained the last step."""


@dataclass(frozen=True, kw_only=True)
class Failed:
    error: str
    """What ended the job, in words a person can act on (with the traceback where the cause is not known)."""


@dataclass(frozen=True, kw_only=True)
class Cancelled:
    """Stopped by request."""


@dataclass(frozen=True, kw_only=True)
class Suspended:
    """Preempted: every member wrote its part of the durable checkpoint of ``step`` and stopped."""

    step: int


Outcome = Succeeded | Failed | Cancelled | Suspended


@dataclass(frozen=True, kw_only=True)
class Training:
    """A Ray Train run of the job's workers is in progress."""

    attempt: int = 1
    """The Train run (a new one replaces a run whose controller failed)."""
    stepped: bool = False
    """A step record arrived: the job trains (the poll says ``running``)."""
    last_step_at: float | None = None
    """When the runner first saw the job's last step done (the run is then given a grace to end by itself)."""
    run_cannot_end: bool = False
    """Ray Train's controller did not answer at the last step: its run cannot end by itself."""
    suspending: bool = False
    """A suspension was asked for: the members write a checkpoint at their next step boundary and stop."""


@dataclass(frozen=True, kw_only=True)
class Ending:
    """Training is being stopped for ``outcome``; the job ends with it once the run has returned."""

    outcome: Outcome
    stepped: bool = False


@dataclass(frozen=True, kw_only=True)
class Ended:
    """Terminal: the outcome is what the service is told, once the runner has swept the job's snapshots."""

    outcome: Outcome
    stepped: bool = False


ControllerState = Training | Ending | Ended


def runner_state(state: ControllerState, *, told: bool) -> RunnerState:
    """What a poll reports for ``state``: the outcome only once it is ``told`` (the job's snapshots swept: the
    service kills the runner as soon as it sees an outcome)."""
    if isinstance(state, Ended) and told:
        o = state.outcome
        return (RunnerState.SUCCEEDED if isinstance(o, Succeeded) else
                RunnerState.CANCELLED if isinstance(o, Cancelled) else
                RunnerState.SUSPENDED if isinstance(o, Suspended) else RunnerState.FAILED)
    return RunnerState.RUNNING if state.stepped else RunnerState.STARTING


def error_of(state: ControllerState, *, told: bool) -> str:
    return state.outcome.error if told and isinstance(state, Ended) and isinstance(state.outcome, Failed) else ""


def suspended_step(state: ControllerState, *, told: bool) -> int | None:
    return state.outcome.step if told and isinstance(state, Ended) and isinstance(state.outcome, Suspended) else None
