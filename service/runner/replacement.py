"""Which datacenter gets a replacement worker after a loss: the runner's decision, apart from doing it.

The runner actor (:meth:`~meridian.service.runner.actor.JobRunner._replace_lost_workers`) gathers what it
knows — the plan's workers per datacenter, the current epoch's members, the nodes Ray reports alive, the
replacements it started that have not joined yet, the datacenters with room for one more worker — and
starts a worker where :func:`replacement_datacenter` says. Pure: tested without Ray. Must never start,
kill or look up an actor itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol


class _Placed(Protocol):
    datacenter: str
    node_id: str


def replacement_datacenter(
    planned_per_dc: Mapping[str, int], members: Iterable[_Placed], *, alive_nodes: set[str],
    pending: Iterable[str] = (), with_room: set[str], newcomer_waiting: bool = False,
) -> str | None:
    """The first datacenter (in plan order) that runs short of its plan and has room, or ``None``.

    ``pending``: the datacenter of each replacement already started but not yet in an epoch (it counts as
    present, so a slow start is not answered with a second worker). ``with_room``: datacenters where a live
    node has the free resources of one worker. One replacement per call: each one re-forms the group, and
    the next call sees the new membership.
    """
    if newcomer_waiting:
        return None  # a new worker already waits to join: let it in before judging what is short
    members = list(members)
    pending = list(pending)
    for dc, planned in planned_per_dc.items():
        have = sum(1 for m in members if m.datacenter == dc and m.node_id in alive_nodes)
        have += pending.count(dc)
        if have < planned and dc in with_room:
            return dc
    return None
