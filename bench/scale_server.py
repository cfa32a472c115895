"""The service that ``meridian bench scale`` measures, run in its own process, and the runner it launches.

The real app, store (SQLite in a temporary folder), planner and supervisor, over a fixed view of simulated
nodes, connected to the bench's Ray cluster. The supervisor launches each job's runner through the real
:class:`~meridian.service.launcher.Launcher` path (a detached, named actor with the launcher's options) and polls
it as it polls any runner; the runner is :class:`SimulatedRunner`: the real :class:`JobRunner` (rendezvous,
liveness, controller, reports, metrics) whose Train run is replaced by a wait (the simulated ranks are the bench's
processes, which call the runner as Ray Train's workers do) and whose cluster view is the simulated nodes.

    python -m meridian.bench.scale_server --ray-address ADDR --data-dir DIR --dcs 2 --nodes-per-dc 192

prints ``READY <url>`` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import threading
from typing import Any

RANKS_PER_NODE = 8
"""Simulated ranks (workers) per simulated node: the node's CPUs, one per worker."""


def node_ids(dcs: int, nodes_per_dc: int) -> list[tuple[str, str]]:
    """(node id, datacenter) of every simulated node, as :func:`meridian.bench.api_server.static_topology` names them."""
    return [(f"node-{d}-{i}", f"dc-{d}") for d in range(dcs) for i in range(nodes_per_dc)]


def _runner_class() -> Any:
    from meridian.service.cluster.topology import ClusterTopology, NodeInfo
    from meridian.service.runner.actor import JobRunner
    from meridian.service.runner.controller.state import Training

    class SimulatedRunner(JobRunner):
        """A job runner whose ranks are simulated: no Train run, and the simulated nodes as its cluster view."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._lost: set[str] = set()
            per_dc = {dc: self.plan.rank_datacenters.count(dc) for dc in self.plan.datacenters}
            self._sim_nodes = [(f"node-{d}-{i}", dc) for d, dc in enumerate(sorted(per_dc))
                               for i in range(math.ceil(per_dc[dc] / RANKS_PER_NODE))]
            self._sim_lock = threading.Lock()

        def _fit(self, attempt: int) -> BaseException | None:
            while isinstance(self._state, Training) and not self._done.wait(0.2):
                pass
            return None

        def _read_topology(self) -> ClusterTopology:
            with self._sim_lock:
                lost = set(self._lost)
            # No free CPUs anywhere: the runner starts no replacement worker for a lost node.
            return ClusterTopology(tuple(
                NodeInfo(node_id=n, datacenter=dc, alive=n not in lost, address="127.0.0.1", is_head=False,
                         cpus=RANKS_PER_NODE, gpus=0, memory_bytes=8 * 2**30, available_cpus=0, available_gpus=0,
                         labels={"datacenter": dc})
                for n, dc in self._sim_nodes))

        def sim_lose_node(self, node_id: str) -> None:
            """Ray's view loses ``node_id`` (the bench stopped its ranks)."""
            with self._sim_lock:
                self._lost.add(node_id)

        def sim_pid(self) -> int:
            return os.getpid()

    return SimulatedRunner


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meridian.bench.scale_server")
    p.add_argument("--ray-address", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--dcs", type=int, default=2)
    p.add_argument("--nodes-per-dc", type=int, default=4)
    args = p.parse_args(argv)

    import ray
    import uvicorn

    from meridian.api.app import create_app
    from meridian.api.auth import AuthSettings
    from meridian.bench.api_server import StaticService, static_topology
    from meridian.service.cluster.connect import NAMESPACE
    from meridian.service.launcher import Launcher
    from meridian.service.supervision.supervisor import Supervisor

    ray.init(address=args.ray_address, namespace=NAMESPACE, log_to_driver=False)
    launcher = Launcher(os.path.join(args.data_dir, "storage"))
    launcher._actor_cls = ray.remote(_runner_class())
    service = StaticService(args.data_dir, static_topology(args.dcs, args.nodes_per_dc, RANKS_PER_NODE))
    service.supervisor = Supervisor(service.store, launcher, read_topology=service.topology,
                                    checkpoint_root=os.path.join(args.data_dir, "checkpoints"))
    service.supervisor.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    app = create_app(service.config, service=service, auth=AuthSettings.load(enabled=False, token_file=""))  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, backlog=1024))
    original_startup = server.startup

    async def startup(sockets: list | None = None) -> None:
        await original_startup(sockets)
        print(f"READY http://127.0.0.1:{sock.getsockname()[1]}", flush=True)

    server.startup = startup  # type: ignore[method-assign]
    try:
        server.run(sockets=[sock])
    finally:
        service.supervisor.stop()
        service.store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
