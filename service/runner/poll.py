"""What one poll of a job's runner says, typed: :class:`RunnerState` and the frozen :class:`RunnerPoll`.

The runner actor (:mod:`meridian.service.runner.actor`) builds a :class:`RunnerPoll`; Ray pickles it to the
service, where the supervisor decides from it (:mod:`meridian.service.supervision.reconcile`) and the tests'
fake launcher builds the same thing. Strings exist only on the wire and in the store, never here.

Must stay importable without Ray or torch: the supervisor's decisions and their tests read it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meridian.service.runner.placement import PlacedRank
from meridian.workers.contracts.events import JobEvent, StallSeen
from meridian.workers.contracts.records import StepRecord


class RunnerLost(RuntimeError):
    """The job's runner actor no longer exists (its node died, or the cluster was restarted)."""


class RunnerState(str, enum.Enum):
    """Where the runner's training is: starting → running → succeeded | failed | cancelled | suspended."""

    STARTING = "starting"  # fit() launched, no step record yet
    RUNNING = "running"  # the first step record arrived
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUSPENDED = "suspended"  # preempted: the job's checkpoint is written, it goes back to the queue

    @property
    def is_terminal(self) -> bool:
        return self in (RunnerState.SUCCEEDED, RunnerState.FAILED, RunnerState.CANCELLED, RunnerState.SUSPENDED)


@dataclass(frozen=True, kw_only=True)
class RunnerPoll:
    """Everything the runner buffered after a cursor, plus its state, its ranks' placement and their stalls."""

    state: RunnerState
    error: str = ""
    """Why training failed (``state`` is ``FAILED``), in one readable paragraph."""
    result: Mapping[str, Any] | None = None
    """What the workers returned once training finished."""
    records: tuple[StepRecord, ...] = ()
    """Per-step records after the cursor, oldest first."""
    events: tuple[JobEvent, ...] = ()
    """Events after the cursor, oldest first (the stall of a rank among them, named once)."""
    cursor: int = 0
    """The runner's sequence number after this poll: the next poll asks for what comes after it."""
    wait_reason: str = ""
    """Why the elastic membership waits (for workers, for a re-formation); empty while it trains."""
    finished: bool = False
    """The membership saw the last step: ranks are idle by design from here on."""
    placement: tuple[PlacedRank, ...] | None = ()
    """Where each rank of the current membership runs, in rank order; ``None``: unchanged since the cursor asked
    after (stored with it)."""
    stalls: tuple[StallSeen, ...] = ()
    """Ranks that have stopped finishing steps, as the runner judges them now."""
    suspended_step: int | None = None
    """With ``state`` ``SUSPENDED``: the step of the checkpoint the job resumes from."""

    def __post_init__(self) -> None:
        if not isinstance(self.state, RunnerState):
            raise TypeError(f"state must be a RunnerState, got {self.state!r}")
