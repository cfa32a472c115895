"""The API server that ``meridian bench api`` measures, run in its own process.

The real app, store (SQLite in a temporary folder), planner, auth and error handling — with a fixed cluster
view instead of Ray and the supervisor's loop not started, so submitted jobs are planned and stored and then
stay queued. What it measures is the control plane's request path, not training.

    python -m meridian.bench.api_server --data-dir DIR --dcs 2 --nodes-per-dc 4 [--token-file F]

prints ``READY <url>`` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import uvicorn

from meridian.api.app import create_app
from meridian.api.auth import AuthSettings
from meridian.service.cluster.topology import ClusterTopology, NodeInfo
from meridian.service.core import ServiceConfig
from meridian.service.store import JobStore
from meridian.service.supervision.supervisor import Supervisor


def static_topology(dcs: int, nodes_per_dc: int, cpus: int) -> ClusterTopology:
    def node(node_id: str, dc: str | None, n_cpus: float) -> NodeInfo:
        return NodeInfo(node_id=node_id, datacenter=dc, alive=True, address="127.0.0.1", is_head=dc is None,
                        cpus=n_cpus, gpus=0, memory_bytes=8 * 2**30, available_cpus=n_cpus, available_gpus=0,
                        labels={"datacenter": dc} if dc else {})

    nodes = [node("head", None, 0)]
    nodes += [node(f"node-{d}-{i}", f"dc-{d}", cpus) for d in range(dcs) for i in range(nodes_per_dc)]
    return ClusterTopology(tuple(nodes))


class StaticService:
    """The parts of :class:`~meridian.service.core.MeridianService` the routes use, without Ray."""

    def __init__(self, data_dir: str, topo: ClusterTopology) -> None:
        self.config = ServiceConfig(data_dir=data_dir)
        self.store = JobStore(self.config.db_url)
        self._topo = topo
        self.supervisor = Supervisor(self.store, launcher=None, read_topology=self.topology,  # type: ignore[arg-type]
                                     checkpoint_root=os.path.join(data_dir, "checkpoints"))
        self.probe_cache = None

    def topology(self) -> ClusterTopology:
        return self._topo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meridian.bench.api_server")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--dcs", type=int, default=2)
    p.add_argument("--nodes-per-dc", type=int, default=4)
    p.add_argument("--cpus-per-node", type=int, default=2)
    p.add_argument("--token-file", default="", help="turn auth on with these tokens")
    args = p.parse_args(argv)
    service = StaticService(args.data_dir, static_topology(args.dcs, args.nodes_per_dc, args.cpus_per_node))
    auth = AuthSettings.load(enabled=bool(args.token_file), token_file=args.token_file)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service.config, service=service, auth=auth),  # type: ignore[arg-type]
                                           log_level="warning", access_log=False, backlog=1024,
                                           # paced clients idle between requests: keep their connections
                                           timeout_keep_alive=75))
    original_startup = server.startup

    async def startup(sockets: list | None = None) -> None:
        await original_startup(sockets)
        print(f"READY http://127.0.0.1:{sock.getsockname()[1]}", flush=True)

    server.startup = startup  # type: ignore[method-assign]
    server.run(sockets=[sock])
    service.store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
