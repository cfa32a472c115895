"""What the recovery benchmark reports, computed from one side's step records — never from formulas — and
when its driver acts (:class:`Phases`).

Every side hands over the records of its rank 0 (or of a replica group that was never killed), oldest first,
each ``{"step": steps completed, "time": wall-clock end of that step, "workers": workers that trained it}``,
plus when the node was killed and, if it was, when a node came back. Pure: tested without a cluster.
"""

from __future__ import annotations

import time
from typing import Any

WINDOW_S = 60.0
"""Post-recovery throughput is measured over this long after the first re-formed step (or what is left of
it before the node returns or the run ends: the report says how long the window was)."""
PRE_KILL_SHARE = 0.5
"""The pre-kill throughput is measured over this last share of the time from the first step to the kill:
the first steps pay for start-up."""


def _rate(records: list[dict[str, Any]]) -> float | None:
    """Steps per second between the first and the last of ``records`` (None under two records)."""
    if len(records) < 2 or records[-1]["time"] <= records[0]["time"]:
        return None
    return (records[-1]["step"] - records[0]["step"]) / (records[-1]["time"] - records[0]["time"])


def recovery_metrics(
    records: list[dict[str, Any]], *, kill_time: float, full_workers: int, survivors: int, tokens_per_step: int,
    resume_step: int | None = None, back_time: float | None = None, window_s: float = WINDOW_S,
) -> dict[str, Any]:  # fmt: skip
    """``kill_to_next_step_s``: kill → end of the first step trained by fewer than ``full_workers`` (the
    re-formed group; the victim's processes can outlive its node's kill by a few steps, so the first step
    stamped after the kill is not it). ``steps_lost``: steps completed before the re-formation minus the step
    the re-formed group resumed from (``resume_step``; by default the step before its first one).
    ``post_recovery_throughput_ratio``: steps/s of the re-formed group over the window ÷ (steps/s before the
    kill × ``survivors`` / ``full_workers``) — every step has the same tokens on every side; a step trained by
    even fewer workers in the window (a survivor briefly out of torchft's quorum) counts as it came. ``scale_up_s``: node back →
    end of the first step trained by ``full_workers`` again."""
    records = sorted(records, key=lambda r: r["time"])
    reformed = [r for r in records if r["time"] > kill_time and r["workers"] < full_workers]
    if not reformed:
        raise RuntimeError("no step was trained by the re-formed group after the kill")
    first = reformed[0]
    resume = first["step"] - 1 if resume_step is None else resume_step
    before_reform = [r for r in records if r["time"] < first["time"] and r["workers"] == full_workers]
    last_old = max([r["step"] for r in before_reform] + [resume])
    pre = [r for r in records if r["time"] <= kill_time and r["workers"] == full_workers]
    if pre:
        since = kill_time - (kill_time - pre[0]["time"]) * PRE_KILL_SHARE
        pre = [r for r in pre if r["time"] >= since]
    end = first["time"] + window_s
    if back_time is not None:
        end = min(end, back_time)
    window = [r for r in reformed if r["time"] <= end]
    before_rate, after_rate = _rate(pre), _rate(window)
    ratio = None
    if before_rate and after_rate is not None:
        ratio = round(after_rate / (before_rate * survivors / full_workers), 3)
    out: dict[str, Any] = {
        "kill_to_next_step_s": round(first["time"] - kill_time, 2),
        "last_step_before_kill": max((r["step"] for r in records if r["time"] <= kill_time), default=0),
        "last_step_before_reforming": last_old,
        "resumed_from_step": resume,
        "steps_lost": max(0, last_old - resume),
        "workers_after": survivors,
        "pre_kill_window_s": round(pre[-1]["time"] - pre[0]["time"], 2) if len(pre) > 1 else 0.0,
        "tokens_per_s_before_kill": round(before_rate * tokens_per_step, 1) if before_rate else None,
        "tokens_per_s_after_recovery": round(after_rate * tokens_per_step, 1) if after_rate is not None else None,
        "post_recovery_window_s": round(window[-1]["time"] - first["time"], 2) if len(window) > 1 else 0.0,
        "post_recovery_throughput_ratio": ratio,
        "scale_up_s": None,
    }
    if back_time is not None:
        full_again = [r for r in records if r["time"] > back_time and r["workers"] == full_workers]
        out["scale_up_s"] = round(full_again[0]["time"] - back_time, 2) if full_again else None
        if not full_again:
            out["scale_up_note"] = "no step trained by every worker again before the run ended"
    return out


class Phases:
    """The driver's timeline of one side: wait for the kill step, kill, wait for the re-formed group's window,
    bring the node back, wait until it trains (or give up on that)."""

    def __init__(self, args: Any, full: int, clock: Any = time.monotonic) -> None:
        """``args``: the benchmark's (``steps``, ``kill_at_step``, ``kill_after_s``, ``back_after_s``,
        ``scale_up_timeout_s``); ``full``: the workers of the unbroken job."""
        self.args, self.full, self.clock = args, full, clock
        self.kill_time: float | None = None
        self.dead_time: float | None = None
        """When every killed process had exited (its sockets closed), as the driver saw it."""
        self.back_time: float | None = None
        self._give_up = 0.0
        self.cpu_samples: list[Any] = []
        """Per-process CPU snapshots the driver takes at the kill and when the node returns."""

    def killed(self, at: float | None = None) -> None:
        """Call right before the kill's first signal; or, for a victim that killed itself, once it is gone,
        with the wall-clock time it stamped right before its kill (``at``)."""
        from meridian.bench.cpu_sample import snapshot

        self.cpu_samples.append(snapshot())
        self.kill_time = time.time() if at is None else at

    def dead(self) -> None:
        """Call once every killed process has exited: the victim's side of the kill is over from here."""
        self.dead_time = time.time()

    def victim_exited_s(self) -> float | None:
        """Seconds from the kill's first signal to the last killed process's exit: what the kernel took to tear
        the victim down, before any peer can see it gone."""
        if self.kill_time is None or self.dead_time is None:
            return None
        return round(self.dead_time - self.kill_time, 3)

    def came_back(self) -> None:
        """Call right before the node (process) is started again."""
        from meridian.bench.cpu_sample import snapshot

        self.back_time = time.time()
        self.cpu_samples.append(snapshot())

    def cpu_report(self) -> dict[str, Any] | None:
        """Who used the CPU from the kill to the node's return (the recovery and its throughput window)."""
        if len(self.cpu_samples) < 2 or self.kill_time is None or self.back_time is None:
            return None
        from meridian.bench.cpu_sample import cpu_between

        return cpu_between(self.cpu_samples[0], self.cpu_samples[1], self.back_time - self.kill_time)

    def next_action(self, records: list[dict[str, Any]]) -> str | None:
        """``"kill"``, ``"back"``, ``"done"`` or ``None`` (keep waiting)."""
        if not records:
            return None
        last = max(records, key=lambda r: r["time"])
        if last["step"] >= self.args.steps:
            return "done"
        if self.kill_time is None:
            started = min(r["time"] for r in records)
            ready = last["step"] >= self.args.kill_at_step and last["time"] >= started + self.args.kill_after_s
            return "kill" if ready else None
        reformed = [r for r in records if r["time"] > self.kill_time and r["workers"] < self.full]
        if self.back_time is None:
            if reformed and last["time"] >= min(r["time"] for r in reformed) + self.args.back_after_s:
                self._give_up = self.clock() + self.args.scale_up_timeout_s
                return "back"
            return None
        if self.clock() > self._give_up:
            return "done"
        return "done" if any(r["time"] > self.back_time and r["workers"] == self.full for r in records) else None
