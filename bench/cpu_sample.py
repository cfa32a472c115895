"""Who used the CPU between two moments: per-process CPU seconds from ``/proc`` (Linux), split into this
benchmark's own process tree (its Ray cluster, workers, torchft processes) and everything else on the
machine. The recovery benchmark takes one sample at the kill and one when the node returns, so a slowdown
after a recovery can be pinned on a process instead of guessed at."""

from __future__ import annotations

import os
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot() -> dict[int, tuple[float, str, int]]:
    """pid → (CPU seconds so far, name, parent pid); empty where ``/proc`` is not there."""
    out: dict[int, tuple[float, str, int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                raw = f.read()
        except OSError:
            continue  # ended meanwhile
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[pid] = (_cpu_s(fields), name, int(fields[1]))
    return out


def machine_busy_cpu_s() -> float:
    """CPU seconds every core of the machine has spent busy so far (``/proc/stat``: all but idle and iowait),
    processes that have ended included; 0 where ``/proc`` is not there."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICK  # user nice system [idle iowait] irq softirq steal


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used so far, as the kernel counts them."""
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    return _cpu_s(raw[raw.rindex(")") + 2:].split())


def _cpu_s(fields: list[str]) -> float:
    """utime + stime of ``/proc/PID/stat``'s fields after the name (the file's fields 14 and 15)."""
    return (int(fields[11]) + int(fields[12])) / _TICK


def _descendants(root: int, parents: dict[int, int]) -> set[int]:
    mine = {root}
    changed = True
    while changed:
        changed = False
        for pid, parent in parents.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                changed = True
    return mine


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return ""


def cpu_between(before: dict[int, tuple[float, str, int]], after: dict[int, tuple[float, str, int]],
                seconds: float, root: int | None = None, top: int = 8) -> dict[str, Any]:
    """CPU seconds used between the two snapshots: this tree's (``root``: this process) and the rest, and the
    ``top`` processes (a process that ended between the samples is not counted)."""
    root = os.getpid() if root is None else root
    mine = _descendants(root, {pid: v[2] for pid, v in after.items()})
    used = {pid: after[pid][0] - before.get(pid, (0.0,))[0] for pid in after}
    rows = sorted(((u, pid) for pid, u in used.items() if u > 0), reverse=True)[:top]
    return {
        "window_s": round(seconds, 1),
        "benchmark_cpu_s": round(sum(u for pid, u in used.items() if pid in mine), 1),
        "other_processes_cpu_s": round(sum(u for pid, u in used.items() if pid not in mine), 1),
        "top": [{"pid": pid, "name": after[pid][1], "cpu_s": round(u, 1), "benchmark": pid in mine,
                 "cmd": _cmd(pid)} for u, pid in rows],
    }
