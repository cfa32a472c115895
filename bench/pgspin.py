"""``meridian bench pgspin``: what Ray's GCS spends on a placement group that lost a bundle with its node.

    meridian bench pgspin --json [--window-s 20]

Why it is here: Ray Train keeps a job's workers in one placement group. After a node dies, Ray 2.60's GCS
re-queues a lost bundle that any other node could take ("feasible") at once, forever, so the head burns a
core while the survivors train. Meridian pins every worker's bundle to its node
(:func:`meridian.service.planning.placement.pin_ranks_to_nodes`), which makes a lost bundle infeasible. This
measures both on the same cluster shape, one after the other, each on a fresh embedded cluster: a head with no
CPUs and two one-CPU nodes labelled ``dc-a``; a 2-bundle placement group whose bundles select the datacenter
(``datacenter``) or their node (``node``); one node killed with no grace; then the GCS process's CPU time over
``--window-s`` seconds, read from ``/proc`` (Linux), after ``--settle-s`` seconds for Ray to notice the death.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from typing import Any

NAME = "pgspin"
HELP = "GCS CPU after a node loss: placement-group bundles pinned to a datacenter vs to their node"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window-s", type=float, default=20.0, help="how long the GCS's CPU is measured (default 20)")
    p.add_argument("--settle-s", type=float, default=5.0, help="wait after the kill before measuring (default 5)")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _one(selector: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group

    from meridian.service.cluster.connect import FAST_FAILURE_DETECTION

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "_system_config": FAST_FAILURE_DETECTION})  # fmt: skip
    try:
        gcs = int(subprocess.check_output(["pgrep", "-n", "-f", "gcs_server"]).split()[0])
        nodes = [cluster.add_node(num_cpus=1, labels={"datacenter": "dc-a"}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        labels = ([{"ray.io/node-id": n.node_id} for n in nodes] if selector == "node"
                  else [{"datacenter": "dc-a"} for _ in nodes])  # fmt: skip
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="SPREAD", bundle_label_selector=labels)
        ray.get(pg.ready(), timeout=60)
        cluster.remove_node(nodes[1], allow_graceful=False)
        time.sleep(args.settle_s)
        cpu0, t0 = _cpu_s(gcs), time.monotonic()
        time.sleep(args.window_s)
        cpu1, t1 = _cpu_s(gcs), time.monotonic()
        return {"bundle_selector": labels[0] if selector == "datacenter" else {"ray.io/node-id": "<its node>"},
                "gcs_cpu_s": round(cpu1 - cpu0, 2), "window_s": round(t1 - t0, 2),
                "gcs_cpu_share": round((cpu1 - cpu0) / (t1 - t0), 3)}  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    out: dict[str, Any] = {"ray": ray.__version__, "loadavg_before": os.getloadavg()}
    for selector in ("datacenter", "node"):
        out[selector] = _one(selector, args)
    out["loadavg_after"] = os.getloadavg()
    return out
