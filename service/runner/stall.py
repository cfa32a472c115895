"""Stall detection: name a rank that has stopped finishing steps.

In synchronous data parallelism one slow rank stalls all of them inside the next collective, so the job's
step counter alone cannot say who is to blame. Every rank sends a heartbeat when its forward + backward of
a step is computed and another when the step is done (:mod:`meridian.workers.loop.observe`). A rank whose last
heartbeat is older than ``factor`` × the median recent step time (never less than ``floor_s``) is silent;
of the silent ranks, those that computed fewer steps than the most advanced rank are the ones holding the
others up (the others sit in the gradient sync waiting for them). If every silent rank is equally far,
they are all named: the collective itself hangs (a link, not a rank). Pure: the
runner calls :func:`find_stalls` with its ranks' heartbeats and names each stall once, as a ``stall`` event.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meridian.workers.contracts.events import EventKind, JobEvent, StallSeen


@dataclass(frozen=True, kw_only=True)
class StallPolicy:
    factor: float = 5.0
    """A rank is stalled after this many median step times without finishing a step."""
    floor_s: float = 5.0
    """...and never before this many seconds (tiny steps make N x median meaninglessly short)."""

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError(f"factor must be > 1, got {self.factor}")
        if self.floor_s < 0:
            raise ValueError(f"floor_s must be >= 0, got {self.floor_s}")


def stall_message(s: StallSeen) -> str:
    return (f"rank {s.rank} in {s.datacenter} on node {s.node_id[:12]} has not finished a step for "
            f"{s.silent_s:.1f} s (> {s.threshold_s:.1f} s = threshold from a median step of "
            f"{s.median_step_s:.2f} s); it last finished step {s.step}")


def stall_event(s: StallSeen, at: float) -> JobEvent:
    return JobEvent(kind=EventKind.STALL, message=stall_message(s), payload=s, time=at)


def find_stalls(
    last_beats: Mapping[int, Mapping[str, Any]], recent_step_s: Iterable[float], now: float,
    placement: Mapping[int, Mapping[str, Any]], policy: StallPolicy = StallPolicy(),
) -> list[StallSeen]:
    """Ranks that went silent (see the module docstring) at time ``now``.

    ``last_beats`` maps rank → ``{"step": steps done, "computed": steps computed (default: step), "time":
    its last heartbeat}``. ``placement`` maps rank → ``{"node_id", "datacenter"}``; ``now`` must come from the same clock as the
    heartbeats' ``time`` (the runner stamps both). Nothing is flagged before any step time is known.
    """
    times = list(recent_step_s)
    if not times:
        return []
    median = statistics.median(times)
    threshold = max(policy.floor_s, policy.factor * median)
    silent_ranks = [r for r in sorted(last_beats) if now - float(last_beats[r]["time"]) > threshold]
    ahead = max((_computed(b) for b in last_beats.values()), default=0)
    behind = [r for r in silent_ranks if _computed(last_beats[r]) < ahead]
    stalls = []
    for rank in behind or silent_ranks:
        beat, where = last_beats[rank], placement.get(rank, {})
        stalls.append(StallSeen(rank=rank, step=int(beat["step"]), silent_s=now - float(beat["time"]),
                            threshold_s=threshold, median_step_s=median, node_id=str(where.get("node_id", "unknown")),
                            datacenter=str(where.get("datacenter", "unknown"))))
    return stalls


def _computed(beat: Mapping[str, Any]) -> int:
    return int(beat.get("computed", beat["step"]))


class StallWatch:
    """Names each stall once: a ``(rank, step)`` pair reported before is not reported again. The runner keeps
    it for the job's life (a restarted service does not name a stall twice). Not while the membership waits or
    after the last step: ranks are idle then by design, and the events say why."""

    def __init__(self, policy: StallPolicy | None = None) -> None:
        self.policy = policy or StallPolicy()
        self.named: set[tuple[int, int]] = set()
        self.current: tuple[StallSeen, ...] = ()

    def check(self, last_beats: Mapping[int, Mapping[str, Any]], recent_step_s: Iterable[float], now: float,
              placement: Mapping[int, Mapping[str, Any]], *, idle: bool) -> list[StallSeen]:
        """The stalls found now that were not named before (``idle``: the ranks are idle by design)."""
        self.current = () if idle or not last_beats else tuple(
            find_stalls(last_beats, recent_step_s, now, placement, self.policy))
        new = [s for s in self.current if (s.rank, s.step) not in self.named]
        self.named |= {(s.rank, s.step) for s in new}
        return new
