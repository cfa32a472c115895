"""The sweep of a job's in-memory snapshot folders on every live host, once the job is over.

A worker killed without its node (a crashed process, a simulated node on one host) leaves its folder in RAM
behind; the runner sweeps at the job's end, and the service for a job whose runner is gone. Must never decide
when: the runner's controller and the service's reconcile do.
"""

from __future__ import annotations

import contextlib
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def sweep_snapshots(job_id: str, timeout_s: float = 30.0) -> list[str]:
    """Remove the job's snapshot folders on every live host. This process sweeps its own host; a task sweeps each
    other address (nodes on one host share its RAM folder). A task needs a worker process, whose start took ~2 s of
    every job's end on a 2-core host, where every node is this one's."""
    from meridian.workers.state.snapshot_paths import remove_snapshot_dirs  # no torch: the task starts fast

    here = ray.util.get_node_ip_address()
    one_per_host = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    removed = remove_snapshot_dirs(job_id) if here in one_per_host else []
    remove = ray.remote(num_cpus=0, max_retries=0)(remove_snapshot_dirs)
    refs = [
        remove.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(job_id)
        for address, node in one_per_host.items() if address != here
    ]  # fmt: skip
    deadline = time.monotonic() + timeout_s
    for ref in refs:
        with contextlib.suppress(Exception):  # best effort: a node that died meanwhile took its RAM with it
            removed += ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
    return removed
