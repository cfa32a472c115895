"""What one poll of a job's runner says, typed: :class:`RunnerState` and the frozen :class:`RunnerPoll`.

The runner actor (:mod:`meridian.service.runner.actor`) builds a :class:`RunnerPoll`; Ray pickles it to the
service, where the supervisor decides from it (:mod:`meridian.service.supervision.reconcile`) and the tests'
fake launcher builds the same thing. Strings exist only on the wire and in the store, never here.

Must stay importable without Ray or torch: the supervisor's decisions and their tests read it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meridian.workers.contracts.records import StepRecord


class RunnerLost(RuntimeError):
    """The job's runner actor no longer exists (its node died, or the cluster was restarted)."""


class RunnerState(str, enum.Enum):
    """Where the runner's training is: starting → running → succeeded | failed | cancelled."""

    STARTING = "starting"  # fit() launched, no step record yet
    RUNNING = "running"  # the first step record arrived
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (RunnerState.SUCCEEDED, RunnerState.FAILED, RunnerState.CANCELLED)


@dataclass(frozen=True, kw_only=True)
class RunnerPoll:
    """Everything the runner buffered after a cursor, plus its state and what stall detection needs."""

    state: RunnerState
    error: str = ""
    """Why training failed (``state`` is ``FAILED``), in one readable paragraph."""
    result: Mapping[str, Any] | None = None
    """What the workers returned once training finished."""
    records: tuple[StepRecord, ...] = ()
    """Per-step records after the cursor, oldest first."""
    events: tuple[Mapping[str, Any], ...] = ()
    """Events after the cursor, oldest first: ``{"kind", "message", "data", "time"}`` (stored as they are)."""
    cursor: int = 0
    """The runner's sequence number after this poll: the next poll asks for what comes after it."""
    wait_reason: str = ""
    """Why the elastic membership waits (for workers, for a re-formation); empty while it trains."""
    finished: bool = False
    """The membership saw the last step: ranks are idle by design from here on."""
    heartbeats: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    """Per rank: ``{"step", "computed", "time"}`` of its last heartbeat (the runner's clock)."""
    recent_step_s: tuple[float, ...] = ()
    now: float = 0.0
    """The runner's clock when it answered: stall detection compares heartbeats with this, not ours."""

    def __post_init__(self) -> None:
        if not isinstance(self.state, RunnerState):
            raise TypeError(f"state must be a RunnerState, got {self.state!r}")
