"""Real Ray clusters for the integration tests: simulated datacenters on this host, and the service on them.

Every cluster here is a ``ray.cluster_utils.Cluster`` this test process starts and shuts down itself (never
``ray stop``, which would kill every Ray process on the host). The head node has no CPUs, so workers land
only on the labelled nodes; failure detection is fast so a killed node is noticed in seconds.
"""

from __future__ import annotations

import contextlib
import shutil
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
