"""The cluster as Meridian sees it: datacenters → nodes → devices, read from Ray.

A node's datacenter is its ``datacenter`` label (``ray start --labels datacenter=dc-a``); nodes without
one are listed but never get workers. This module only reads Ray's state and turns it into frozen values;
deciding what to do with them is the planner's job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

DATACENTER_LABEL = "datacenter"


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    datacenter: str | None
    alive: bool
    address: str
    is_head: bool
    cpus: float
    gpus: float
    memory_bytes: float
    available_cpus: float
    available_gpus: float
    labels: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "datacenter": self.datacenter, "alive": self.alive, "address": self.address,
            "is_head": self.is_head,
            "resources": {"CPU": self.cpus, "GPU": self.gpus, "memory_gb": round(self.memory_bytes / 2**30, 2)},
            "available": {"CPU": self.available_cpus, "GPU": self.available_gpus},
            "labels": self.labels,
        }


@dataclass(frozen=True)
class ClusterTopology:
    nodes: tuple[NodeInfo, ...]

    @property
    def alive_nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.alive)

    @property
    def datacenters(self) -> tuple[str, ...]:
        """Datacenters with at least one live node, sorted by name."""
        return tuple(sorted({n.datacenter for n in self.alive_nodes if n.datacenter}))

    def nodes_in(self, dc: str, *, alive_only: bool = True) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.datacenter == dc and (n.alive or not alive_only))

    def node(self, node_id: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def with_everything_free(self) -> ClusterTopology:
        """This cluster with none of its resources in use: what an admission check against it refuses, the
        cluster can never hold as it is, however long a job waits."""
        return ClusterTopology(tuple(replace(n, available_cpus=n.cpus, available_gpus=n.gpus) for n in self.nodes))

    def has_gpus(self, dcs: tuple[str, ...]) -> bool:
        """Whether a job in ``dcs`` trains on GPUs: every one of them has a live node with a GPU. A node without
        one there (a CPU-only head labelled into the datacenter) then holds no worker, instead of turning the
        whole job into a CPU job on the GPU nodes; a datacenter with no GPU at all does (every rank runs the same
        code on the same kind of device)."""
        return bool(dcs) and all(any(n.gpus > 0 for n in self.nodes_in(dc)) for dc in dcs)

    def to_dict(self) -> dict[str, Any]:
        dcs = sorted({n.datacenter for n in self.nodes if n.datacenter})
        return {
            "datacenters": [
                {
                    "name": dc,
                    "alive_nodes": len(self.nodes_in(dc)),
                    "nodes": [n.to_dict() for n in self.nodes_in(dc, alive_only=False)],
                    "resources": {
                        "CPU": sum(n.cpus for n in self.nodes_in(dc)),
                        "GPU": sum(n.gpus for n in self.nodes_in(dc)),
                    },
                }
                for dc in dcs
            ],
            "unlabelled_nodes": [n.to_dict() for n in self.nodes if not n.datacenter],
        }


def read_topology() -> ClusterTopology:
    """Snapshot of the connected Ray cluster (``ray.init`` must have run)."""
    import ray

    try:
        from ray._private.state import available_resources_per_node

        available = available_resources_per_node()
    except Exception:  # noqa: BLE001 - a private API: without it, availability reads as "unknown = total"
        available = {}
    nodes = []
    for n in ray.nodes():
        res = n.get("Resources", {}) or {}
        labels = {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")}
        avail = available.get(n["NodeID"], res)
        nodes.append(NodeInfo(
            node_id=n["NodeID"],
            datacenter=labels.get(DATACENTER_LABEL),
            alive=bool(n.get("Alive")),
            address=n.get("NodeManagerAddress", ""),
            is_head="node:__internal_head__" in res,
            cpus=float(res.get("CPU", 0.0)),
            gpus=float(res.get("GPU", 0.0)),
            memory_bytes=float(res.get("memory", 0.0)),
            available_cpus=float(avail.get("CPU", 0.0)),
            available_gpus=float(avail.get("GPU", 0.0)),
            labels=labels,
        ))
    return ClusterTopology(tuple(sorted(nodes, key=lambda n: (n.datacenter or "~", n.node_id))))
