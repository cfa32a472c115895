"""Whether the look-ahead takes over, decided on what the job's own steps measured.

``sync.lookahead_when_exposed`` arms it: the engine runs exactly as ``local_lookahead`` does, but where the
look-ahead would take over it first measures, then tries it, and keeps whichever stepped faster::

    exact steps   skip | measure: each step's wall time and the time it waited for the sync (exposed)
                  check (every rank): exposed <= lookahead_when_exposed × compute  →  exact sync, decided
    trial         the look-ahead: skip | measure each step's wall time
                  decide (every rank): the look-ahead stays iff its median step is at least
                  PREFERRED_WITHIN faster than the exact median step; else the sync in flight is committed and
                  the job goes on exactly

Exposed time alone cannot decide: where ranks share cores (4 ranks on 2 CPUs), a rank waiting for the sync is a
rank whose core serves another rank, and the look-ahead's extra AdamW pass and copies then cost more than the
wait it hides (measured: the demo job on the embedded cluster, with no link at all, waited 26 ms of 158 a step,
and its look-ahead steps took 216 ms against 185 exact). So the trial measures the one figure that matters, the
step time, on both sides.

Each check all-reduces the ranks' medians (max): every rank applies the same rule to the same figures and
decides the same. The decision is the engine's, for its epoch: a resumed job or a re-formed epoch (another
layout, perhaps no inter-DC link left) measures again. Never talks to the service; the step record carries the
decision.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from meridian.workers.contracts.config import (
    LOOKAHEAD_DECISION_MEASURE,
    LOOKAHEAD_DECISION_SKIP,
    LOOKAHEAD_DECISION_STEPS,
)

PREFERRED_WITHIN = 0.01
"""The look-ahead changes where gradients are evaluated (loss at equal tokens within ~1% of exact sync's, not
equal): it stays only if it saves at least this share of the exact step."""


@dataclass(frozen=True)
class LookaheadDecision:
    """What the ranks decided, and on which figures (each the slowest rank's median)."""

    lookahead: bool
    at_step: int
    """The committed updates when it was decided."""
    exposed_s: float
    """Exact steps: the wait for the gradient sync."""
    compute_s: float
    """Exact steps: the rest of the step."""
    exact_step_s: float
    lookahead_step_s: float | None
    """The trial's steps (``None``: no trial, the exact sync hid well enough)."""
    threshold: float
    steps_measured: int
    """Exact steps measured (a trial measures as many, fewer if a validation pass fell inside it)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_record(self) -> dict[str, Any]:
        """What a step record carries: the figures and the sentence that says why."""
        return {**self.to_dict(), "reason": self.reason}

    @property
    def reason(self) -> str:
        share = self.exposed_s / self.compute_s if self.compute_s > 0 else float("inf")
        exact = (f"exact sync left {self.exposed_s * 1e3:.1f} ms a step waiting for the sync ({share:.0%} of "
                 f"{self.compute_s * 1e3:.1f} ms of compute; limit {self.threshold:.0%})")
        if self.lookahead_step_s is None:
            return f"exact sync kept: {exact}, over {self.steps_measured} steps"
        trial = (f"{self.steps_measured} steps at the look-ahead took {self.lookahead_step_s * 1e3:.1f} ms each "
                 f"against {self.exact_step_s * 1e3:.1f} ms exact (medians)")
        if self.lookahead:
            return f"one step late at a local look-ahead, kept: {exact}, and {trial}"
        return f"exact sync again: {exact}, but {trial}; the look-ahead stays only if it saves {PREFERRED_WITHIN:.0%}"


class _Steps:
    """Each step's figures, the first ``LOOKAHEAD_DECISION_SKIP`` left out, the last ``LOOKAHEAD_DECISION_MEASURE``
    kept."""

    def __init__(self) -> None:
        self.seen = 0
        self.rows: list[tuple[float, float]] = []  # (wall, exposed)

    def add(self, wall_s: float | None, exposed_s: float) -> None:
        if wall_s is not None and self.seen >= LOOKAHEAD_DECISION_SKIP:
            self.rows.append((wall_s, exposed_s))
            del self.rows[:-LOOKAHEAD_DECISION_MEASURE]
        self.seen += 1

    def medians(self) -> tuple[float, float]:
        """(wall, exposed); with nothing measured an endless step, which no rule prefers."""
        if not self.rows:
            return math.inf, 0.0
        walls, exposed = zip(*self.rows, strict=True)
        return statistics.median(walls), statistics.median(exposed)


class LookaheadChooser:
    """Measures the exact steps, tries the look-ahead if they waited for the sync, and decides, collectively."""

    def __init__(self, threshold: float, earliest: int) -> None:
        self.threshold = threshold
        self.earliest = earliest
        """The look-ahead never starts before this many committed updates (``sync.lookahead_after``)."""
        self.decision: LookaheadDecision | None = None
        self.trying = False
        """The trial runs: the engine syncs one step late, at the look-ahead."""
        self._due: int | None = None
        self._trial_due = 0
        self._last_end: float | None = None
        self._exact, self._trial = _Steps(), _Steps()
        self._exact_figures: tuple[float, float, float] = (0.0, 0.0, 0.0)  # exposed, compute, step

    @property
    def lookahead(self) -> bool:
        """Whether the engine syncs one step late now: during the trial, and after it if the look-ahead stayed."""
        return self.trying or (self.decision is not None and self.decision.lookahead)

    def due_at(self, committed: int) -> int:
        """The committed updates at which the exact steps are checked: fixed at its first call (after any
        restore)."""
        if self._due is None:
            self._due = max(self.earliest, committed + LOOKAHEAD_DECISION_STEPS)
        return self._due

    def skip_next(self) -> None:
        """Leave the next step unmeasured: what ran since the last one (a validation pass, which also lands a
        trial's sync in flight) is not a step's time."""
        self._last_end = None

    def after_step(self, committed: int, exposed_s: float, group: dist.ProcessGroup,
                   device: torch.device) -> LookaheadDecision | None:
        """Every rank, at the end of each step until decided: keep the step's figures; at a check, every rank of
        ``group`` decides the same. Returns the decision on the step it was taken."""
        now = time.perf_counter()
        wall = None if self._last_end is None else now - self._last_end
        self._last_end = now
        if not self.trying:
            self._exact.add(wall, exposed_s)
            if committed < self.due_at(committed):
                return None
            step, exposed = _max_over(group, device, committed, *self._exact.medians())
            self._exact_figures = (exposed, max(0.0, step - exposed), step)
            if exposed > self.threshold * self._exact_figures[1]:
                self.trying = True  # the next step syncs one step late
                self._trial_due = committed + LOOKAHEAD_DECISION_STEPS
                self._last_end = None  # the trial's steps are timed afresh (and its first ones skipped)
                return None
            return self._decide(committed, None, lookahead=False)
        self._trial.add(wall, exposed_s)
        if committed < self._trial_due:
            return None
        (step,) = _max_over(group, device, committed, self._trial.medians()[0])
        self.trying = False
        return self._decide(committed, step, lookahead=step < (1 - PREFERRED_WITHIN) * self._exact_figures[2])

    def _decide(self, committed: int, trial_step_s: float | None, *, lookahead: bool) -> LookaheadDecision:
        exposed, compute, step = self._exact_figures
        self.decision = LookaheadDecision(
            lookahead=lookahead, at_step=committed, exposed_s=exposed, compute_s=compute, exact_step_s=step,
            lookahead_step_s=trial_step_s, threshold=self.threshold, steps_measured=len(self._exact.rows),
        )  # fmt: skip
        return self.decision


def _max_over(group: dist.ProcessGroup, device: torch.device, committed: int, *values: float) -> tuple[float, ...]:
    """Each value's maximum over the ranks of ``group`` (one small all-reduce), checking on the way that every
    rank is at the same ``committed`` update: ranks that were not would be pairing this all-reduce with another
    collective of the same group."""
    t = torch.tensor([committed, -committed, *values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    most, least, *out = t.tolist()
    if most != -least:
        raise RuntimeError(f"the armed look-ahead's check found ranks at {-least:.0f} to {most:.0f} committed "
                           "updates: they must all decide at the same step (a restore gave them different states?)")
    return tuple(float(v) for v in out)
