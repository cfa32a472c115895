"""Real Ray clusters for the integration tests: simulated datacenters on this host, and the service on them.

Every cluster here is a ``ray.cluster_utils.Cluster`` this test process starts and shuts down itself (never
``ray stop``, which would kill every Ray process on the host). The head node has no CPUs, so workers land
only on the labelled nodes; failure detection is fast so a killed node is noticed in seconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from meridian.api.server import serve_in_thread
from meridian.service.cluster.connect import FAST_FAILURE_DETECTION
from meridian.service.core import MeridianService, ServiceConfig
from meridian.workers.state.snapshot_paths import every_snapshot_dir, orphaned_snapshot_dirs, owner_alive


@contextlib.contextmanager
def local_cluster(node_datacenters: Sequence[str], system_config: dict[str, Any] | None = None) -> Iterator[Any]:
    """A cluster with a CPU-less head and one one-CPU node per entry, labelled ``datacenter=<entry>``;
    ``cluster.nodes_by_dc`` maps each datacenter to its nodes, in the order given."""
    from ray.cluster_utils import Cluster

    before = set(every_snapshot_dir())
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {**FAST_FAILURE_DETECTION, **(system_config or {})}})  # fmt: skip
    try:
        cluster.nodes_by_dc = {}
        for dc in node_datacenters:
            cluster.nodes_by_dc.setdefault(dc, []).append(cluster.add_node(num_cpus=1, labels={"datacenter": dc}))
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        # A job still running when a test ends dies with the cluster, and so does the runner that would have
        # removed its workers' snapshots from RAM: remove the folders this cluster's agents left, once those have
        # exited (a killed agent's exit can take a moment after the shutdown returns).
        deadline = time.monotonic() + 10
        while True:
            new = set(every_snapshot_dir()) - before
            for folder in set(orphaned_snapshot_dirs()) & new:
                shutil.rmtree(folder, ignore_errors=True)
            if not any(owner_alive(folder) for folder in new) or time.monotonic() > deadline:
                break
            time.sleep(0.2)


@contextlib.contextmanager
def service_client(ray_address: str, data_dir: str, **config: Any) -> Iterator[httpx.Client]:
    """The service on ``ray_address``, served over HTTP on a free local port; a client of it. ``config``: more
    :class:`ServiceConfig` fields."""
    service = MeridianService(ServiceConfig(data_dir=data_dir, ray_address=ray_address, poll_interval_s=0.3,
                                            **config)).start()
    try:
        with serve_in_thread(service) as url, httpx.Client(base_url=url, timeout=30) as client:
            yield client
    finally:
        service.stop()


FOUR_NODES = ("dc-a", "dc-a", "dc-b", "dc-b")
"""Two datacenters of two one-CPU nodes: the cluster of the preemption, resume and service API tests."""
TWO_NODES = ("dc-a", "dc-b")
"""One one-CPU node in each of two datacenters: the cluster of most end-to-end tests."""


def cluster_idle(cluster: Any, timeout_s: float = 30.0) -> str | None:
    """``None`` once every node of ``cluster`` is alive with all its CPUs free and no placement group is left, within
    ``timeout_s``; else what was still there. Connects to the cluster for the look and disconnects after.

    The actors a module left alive go first, as its own cluster's shutdown would end them: a job's detached runner
    (a job a test cancelled as it ended, or left running) and Ray Train's ``PlacementGroupCleaner``. Ray's own
    (``_AutoscalingCoordinatorActor``, started once by Ray Train and kept; their names start with _) stay."""
    import ray
    from ray._private.state import actors  # the GCS's actor table (this cluster has no dashboard)

    nodes = sum(len(ns) for ns in cluster.nodes_by_dc.values())
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    try:
        for actor in actors().values():
            if actor["State"] != "DEAD" and not actor["ActorClassName"].startswith("_") and actor.get("Pid"):
                with contextlib.suppress(ProcessLookupError):  # every node of this cluster runs on this host
                    os.kill(actor["Pid"], signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
            free = ray.available_resources().get("CPU", 0)
            groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
            live = [a["ActorClassName"] for a in actors().values()
                    if a["State"] != "DEAD" and not a["ActorClassName"].startswith("_")]
            if len(alive) == nodes and free == nodes and not groups and not live:
                return None
            if time.monotonic() > deadline:
                return f"{len(alive)}/{nodes} nodes, {free} CPUs free, placement groups {groups}, actors {live}"
            time.sleep(0.5)
    finally:
        ray.shutdown()


class KeptCluster:
    """A :func:`local_cluster` kept from one test module to the next that asks for the same nodes, so that they
    share its start (~20-30 s on a loaded 2-core host, the shutdown up to 10 s more). The next module gets it once it
    is idle (:func:`cluster_idle`, which first ends the actors a module left): one still busy or short of a node
    after 60 s is shut down and a fresh one started. ``tests/conftest.py`` runs the tests that ask for the same nodes one after the other and shuts the
    cluster down after the last of them."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._nodes: tuple[str, ...] = ()
        self._cluster: Any = None

    def get(self, node_datacenters: Sequence[str]) -> Any:
        nodes = tuple(node_datacenters)
        if self._cluster is not None and nodes != self._nodes:
            self.close()
        if self._cluster is not None and (busy := cluster_idle(self._cluster, timeout_s=60)) is not None:
            print(f"the kept cluster is not idle after 60 s ({busy}): a fresh one for this module", file=sys.stderr)
            self.close()
        if self._cluster is None:
            stack = contextlib.ExitStack()
            self._cluster = stack.enter_context(local_cluster(nodes))
            self._stack, self._nodes = stack, nodes
        return self._cluster

    def close(self) -> None:
        stack, self._stack, self._cluster = self._stack, None, None
        if stack is not None:
            stack.close()


kept_cluster = KeptCluster()
