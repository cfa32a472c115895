"""A profiler request carried to the ranks that are to record it: from the job's runner, once, over each named
rank's agent's liveness port (:mod:`meridian.workers.elastic.liveness`); nothing is added to any step.

Deciding who is told is :func:`profile_targets`, a pure function of the current epoch's members (in rank order);
:func:`deliver` does the telling, each with a timeout.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meridian.service.runner.membership import Member
from meridian.workers.elastic.liveness import profile_message


class NoSuchRank(ValueError):
    """A rank the job's current epoch does not have (or the job has no epoch yet)."""


@dataclass(frozen=True)
class ProfileDelivery:
    world_size: int
    """Ranks of the epoch the request went to."""
    told: tuple[int, ...]
    """Ranks whose agent took the request."""
    unreachable: tuple[int, ...] = ()
    """Ranks whose agent did not answer (it is restarting, or its host is gone)."""


def profile_targets(members: Sequence[Member], ranks: Sequence[int]) -> list[tuple[int, Member]]:
    """``(rank, member)`` of each rank asked for; :class:`NoSuchRank` naming the ranks the epoch lacks."""
    if not members:
        raise NoSuchRank("the job has not formed its first epoch yet (its workers are starting); ask again once it "
                         "trains")
    lacking = sorted(r for r in set(ranks) if not 0 <= r < len(members))
    if lacking:
        raise NoSuchRank(f"ranks {lacking} are not in the job's current epoch, which has ranks 0-{len(members) - 1}")
    return [(r, members[r]) for r in sorted(set(ranks))]


def send_profile(address: str, port: int, request_id: str, steps: int, timeout_s: float = 2.0) -> bool:
    """Tell one agent; ``True`` once it has taken the request."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as conn:
            conn.sendall(profile_message(request_id, steps))
            return conn.recv(16).startswith(b"ok")
    except OSError:
        return False


def deliver(members: Sequence[Member], request_id: str, steps: int, ranks: Sequence[int], *,
            send: Callable[[str, int, str, int], bool] = send_profile) -> ProfileDelivery:
    told, unreachable = [], []
    for rank, m in profile_targets(members, ranks):
        (told if m.probe_port and send(m.address, m.probe_port, request_id, steps) else unreachable).append(rank)
    return ProfileDelivery(world_size=len(members), told=tuple(told), unreachable=tuple(unreachable))
