"""Subgroups time out with the job's collective timeout, not torch's 30 minutes (workers/distributed/groups.py).

A silent peer (a host that lost its power or network: sockets open, nothing sent) must fail the datacenter and
inter-datacenter collectives, which run on subgroups, after ``collective_timeout_s``, as it fails the default
group's; then the ranks leave their epoch and re-form.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from meridian.workers.distributed.groups import default_group_timeout
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.distributed.ports import free_port

TIMEOUT_S = 2.0
SILENT_S = 10.0


def _one_silent_peer(rank: int, world: int, port: int) -> dict:
    dist.destroy_process_group()  # run_processes' group has torch's default timeout: again, with the job's
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    groups = DCGroups(DCLayout(("dc-a", "dc-b")), rank)
    inter = next(iter(groups.inter_dc.values()))
    if rank == 1:
        time.sleep(SILENT_S)  # alive, connected, sends nothing
        return {}
    started = time.monotonic()
    try:
        dist.recv(torch.zeros(4), src=1, group=inter)
        failed = False
    except RuntimeError:
        failed = True
    return {"failed": failed, "waited_s": time.monotonic() - started, "timeout": default_group_timeout()}


def test_an_inter_datacenter_receive_from_a_silent_peer_fails_after_the_job_s_timeout():
    out = run_processes(_one_silent_peer, 2, free_port(), timeout_s=120)[0]
    assert out["timeout"] == timedelta(seconds=TIMEOUT_S)
    # On a subgroup made without the timeout it waited until the peer ended (SILENT_S), not TIMEOUT_S.
    assert out["failed"] and out["waited_s"] < TIMEOUT_S + 3, out
