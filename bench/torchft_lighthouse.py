"""torchft's lighthouse in a process of its own, and what its log says about each quorum it formed.

``python -m meridian.bench.torchft_lighthouse [--heartbeat-timeout-ms N]`` starts torchft 0.2's lighthouse
(``min_replicas=1``, torchft's defaults for everything else: a 100 ms join timeout and tick, a 5 s heartbeat
timeout), prints its address as one line on stdout and runs until its stdin closes. The recovery benchmark
starts it with ``RUST_LOG=info`` and its stderr in a file: the lighthouse logs every quorum decision there
("Quorum status: ..." with its reason, then "Quorum! ..." when one forms), and :func:`quorums` reads them back,
so the benchmark can say why torchft's survivors waited as long as they did.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from datetime import datetime

_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?) \[\w+\] \[torchft::lighthouse\] - (.*)$")
_STATUS = re.compile(r"^Quorum status: (.*?) \[(\d+)/(\d+) participants healthy\]\[(\d+) heartbeating\]")
_QUORUM = re.compile(r"^Quorum! Quorum \{ quorum_id: (\d+), participants: \[(.*)")


@dataclass(frozen=True)
class Quorum:
    """One quorum the lighthouse formed, as its log tells it."""

    time: float
    """When it formed (the log's local wall-clock time, as seconds since the epoch)."""
    quorum_id: int
    participants: int
    heartbeating: int
    """Replica groups whose heartbeat the lighthouse had seen within its timeout when it formed."""
    reason: str
    """The lighthouse's reason for forming it ("Fast quorum found!", "Valid quorum found")."""
    held_by: str | None
    """The last reason it gave for not forming a quorum since the one before (None if it formed at once)."""


def quorums(log: str) -> list[Quorum]:
    """Every quorum in a lighthouse's ``RUST_LOG=info`` log, oldest first. A status line that ends a wait
    carries the group counts; the ``Quorum!`` line after it, the quorum's id and members."""
    out: list[Quorum] = []
    status: tuple[str, int] | None = None  # (reason, heartbeating) of the last status line
    held_by: str | None = None
    for line in log.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        stamp, message = m.groups()
        if s := _STATUS.match(message):
            if status is not None and not status[0].startswith(("Fast quorum", "Valid quorum found")):
                held_by = status[0]
            status = (s.group(1), int(s.group(4)))
        elif (q := _QUORUM.match(message)) and status is not None:
            out.append(Quorum(time=datetime.fromisoformat(stamp).timestamp(), quorum_id=int(q.group(1)),
                              participants=q.group(2).count("replica_id:"), heartbeating=status[1],
                              reason=status[0], held_by=held_by))  # fmt: skip
            status, held_by = None, None
    return out


def reformed_quorum(log: str, *, kill_time: float, full: int) -> dict[str, object] | None:
    """The first quorum of fewer than ``full`` groups formed after ``kill_time``, described for the report:
    how long after the kill it formed, its size, how many groups still counted as alive, the lighthouse's reason,
    what held it until then, and whether it waited for the dead group's heartbeat to expire (it formed only once
    fewer than ``full`` groups were heartbeating). None if the log has no such quorum."""
    for q in quorums(log):
        if q.time > kill_time and q.participants < full:
            return {"formed_after_kill_s": round(q.time - kill_time, 3), "participants": q.participants,
                    "heartbeating": q.heartbeating, "reason": q.reason, "held_by": q.held_by,
                    "waited_for_heartbeat_timeout": q.heartbeating < full}  # fmt: skip
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bind", default="[::]:0")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=None, help="default: torchft's own (5,000 ms)")
    args = p.parse_args()

    from torchft._torchft import LighthouseServer

    # min_replicas=1 lets the quorum shrink to any number of survivors, as Meridian's min_workers=1 does.
    lighthouse = LighthouseServer(bind=args.bind, min_replicas=1, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    print(lighthouse.address(), flush=True)
    try:
        sys.stdin.read()  # until the benchmark closes it (or dies)
    finally:
        lighthouse.shutdown()


if __name__ == "__main__":
    main()
