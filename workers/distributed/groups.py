"""Subgroups that wait as long as the job's default group, not torch's 30 minutes.

``dist.new_group`` does not inherit the default group's timeout: without one it takes torch's default (30
minutes for gloo). Measured here (torch 2.13, gloo): with the default group made with a 5 s timeout, a receive
on the default group failed after 5.0 s when its peer stayed silent, but the same receive on a subgroup of the
same two ranks waited 25 s, until the peer exited. A silent peer (a host that lost its power or network) then
held the datacenter and inter-datacenter collectives, which all run on subgroups, for half an hour, whatever
``collective_timeout_s`` said. Every subgroup is made here, with the default group's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


def default_group_timeout() -> timedelta | None:
    """The timeout the default group was made with (its CPU backend's; the same for every backend of a group
    made per device type), or ``None`` if this torch does not say (then torch's default applies)."""
    try:
        default = dist.distributed_c10d._get_default_group()
        return default._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def new_group(ranks: Sequence[int], *, backend: str | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` with the default group's timeout."""
    return dist.new_group(list(ranks), backend=backend, timeout=default_group_timeout())
