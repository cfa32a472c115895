"""The Ray clusters ``meridian bench recovery`` kills a node of: the embedded one, or the ``ray start`` path.

- ``embedded``: ``ray.cluster_utils.Cluster`` in this process's care, with the fast health checks Meridian sets
  on clusters it starts itself. A node's death is a SIGKILL of its raylet and of everything it started, at
  once (as on the other path), then ``remove_node`` for Ray's bookkeeping.
- ``ray-start``: what a user runs, ``ray start --head`` and ``ray start --address … --labels datacenter=…`` per
  node, with Ray's default health checks. Its nodes are the network lab's (:mod:`meridian.lab`):
  each datacenter in its own network namespace, joined over real TCP through the delay line (``--lab-rtt-ms``).
  A node's death is a SIGKILL of its raylet, then of everything it started, as when a machine dies; it comes
  back with the same ``ray start`` command. Needs root, like the lab.

Both offer the same four operations to the sides: ``address``, ``node_ids(dc)``, ``kill(node_id, at_kill,
at_dead)``, ``add(dc)``, and ``shutdown()``. ``at_kill`` runs right before the first SIGKILL, after the node's
processes are found: the torchft side's clock starts right before its SIGKILL too. ``at_dead`` runs once every
process of the node has exited.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

CLUSTERS = ("embedded", "ray-start")
LAB_NAME = "bench-recovery"


def dc_name(d: int) -> str:
    return f"dc-{chr(ord('a') + d)}"


class EmbeddedCluster:
    def __init__(self, args: argparse.Namespace) -> None:
        from ray.cluster_utils import Cluster

        from meridian.service.cluster.connect import FAST_FAILURE_DETECTION, dashboard_port

        # The dashboard is on: the Ray Train side finds a worker's node through the state API.
        self._cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": True, "dashboard_port": dashboard_port(),
            "_system_config": FAST_FAILURE_DETECTION})
        self._nodes: dict[str, list[Any]] = {}
        for d in range(args.dcs):
            for _ in range(args.nodes_per_dc):
                self.add(dc_name(d))
        self._cluster.wait_for_nodes()
        self.address = self._cluster.address

    def node_ids(self, dc: str) -> list[str]:
        return [n.node_id for n in self._nodes.get(dc, [])]

    def kill(self, node_id: str, at_kill: Callable[[], None] | None = None,
             at_dead: Callable[[], None] | None = None) -> None:
        for nodes in self._nodes.values():
            for n in nodes:
                if n.node_id == node_id:
                    from meridian.lab.lab import kill_ray_node

                    nodes.remove(n)
                    # Every process of the node at once, as on the ray-start path and as a machine dies:
                    # Ray's remove_node kills only the node's Ray processes, and its workers (with their
                    # training processes) lived on for ~0.7 s, training steps "after the kill".
                    kill_ray_node(node_id, at_kill=at_kill, at_dead=at_dead)
                    self._cluster.remove_node(n, allow_graceful=False)  # Ray's bookkeeping of the node
                    return
        raise ValueError(f"node {node_id} is not one of this cluster's")

    def add(self, dc: str) -> None:
        self._nodes.setdefault(dc, []).append(self._cluster.add_node(num_cpus=1, labels={"datacenter": dc}))

    def shutdown(self) -> None:
        self._cluster.shutdown()


class RayStartCluster:
    def __init__(self, args: argparse.Namespace) -> None:
        from meridian.lab import lab

        self._lab = lab
        lab.down_if_up(LAB_NAME)
        self.state = lab.up({dc_name(d): args.nodes_per_dc for d in range(args.dcs)}, rtt_ms=args.lab_rtt_ms,
                            gbps=args.lab_gbps, name=LAB_NAME)
        self.address = self.state.ray_address
        self._dead: dict[str, list[Any]] = {}

    def _alive(self) -> list[dict[str, Any]]:
        return [n for n in self._lab.alive_nodes(self.state) if n["labels"].get("datacenter")]

    def node_ids(self, dc: str) -> list[str]:
        return [n["node_id"] for n in self._alive() if n["labels"]["datacenter"] == dc]

    def kill(self, node_id: str, at_kill: Callable[[], None] | None = None,
             at_dead: Callable[[], None] | None = None) -> None:
        node = next((n for n in self._alive() if n["node_id"] == node_id), None)
        if node is None:
            raise ValueError(f"node {node_id} is not an alive node of the lab")
        dc = next(d for d in self.state.layout.datacenters if d.name == node["labels"]["datacenter"])
        self._lab.kill_ray_node(node_id, at_kill=at_kill, at_dead=at_dead)
        self._dead.setdefault(dc.name, []).append(next(n for n in dc.nodes if n.ip == node["ip"]))

    def add(self, dc: str) -> None:
        """Start the killed node of ``dc`` again (same address and ports), once Ray has seen it gone."""
        node = self._dead[dc].pop(0)
        dc_obj = next(d for d in self.state.layout.datacenters if d.name == dc)
        deadline = time.monotonic() + 60
        while any(n["ip"] == node.ip for n in self._alive()) and time.monotonic() < deadline:
            time.sleep(1.0)  # Ray's default health checks take ~15 s to mark it dead
        self._lab.start_node(self.state, dc_obj, node)

    def shutdown(self) -> None:
        self._lab.down(LAB_NAME)


def make_cluster(args: argparse.Namespace) -> EmbeddedCluster | RayStartCluster:
    return RayStartCluster(args) if args.cluster == "ray-start" else EmbeddedCluster(args)
