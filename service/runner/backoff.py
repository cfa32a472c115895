"""How often the runner may ask Ray about something that is not changing: per key, at once the first time,
then after ``initial_s``, doubling up to ``max_s`` for as long as the answer stays the same (a replacement
still starting, a cluster read that keeps failing). A change resets it. Pure: tested with a fake clock.

Why: the runner's watch ticks every 0.5 s. Asking Ray's state API (served by the dashboard) or the GCS that
often about something that does not move costs the head node's CPU exactly when a node has just died and
the head is busiest, and on a small machine that CPU is the training's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    initial_s: float = 1.0
    max_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _next: dict[Hashable, float] = field(default_factory=dict)
    _delay: dict[Hashable, float] = field(default_factory=dict)

    def due(self, key: Hashable) -> bool:
        """May ``key`` be asked about now?"""
        return self.clock() >= self._next.get(key, float("-inf"))

    def unchanged(self, key: Hashable) -> None:
        """The answer was the same as before (or the call failed): wait longer before the next one."""
        delay = self._delay.get(key, self.initial_s / 2) * 2
        delay = min(delay, self.max_s)
        self._delay[key] = delay
        self._next[key] = self.clock() + delay

    def changed(self, key: Hashable) -> None:
        """Something happened: ask again at the normal pace."""
        self._delay.pop(key, None)
        self._next.pop(key, None)

    def delay(self, key: Hashable) -> float:
        return self._delay.get(key, 0.0)
