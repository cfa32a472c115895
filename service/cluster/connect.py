"""Connect the service to Ray: an existing cluster, or an embedded local one with simulated datacenters.

The embedded cluster (``--local-datacenters dc-a:2,dc-b:2``) runs one Ray node per simulated machine on
this host, each labelled ``datacenter=<name>``, plus a head node with no worker capacity. Meridian starts
it with fast failure detection (a dead node is noticed in ~3 s instead of ~17 s) and stops only what it
started — never ``ray stop``, which would kill every Ray process on the host.

GPUs: every Ray node on one host would detect *all* the host's GPUs, so four simulated nodes on a one-GPU
workstation would each offer "1 GPU" and the planner would put four NCCL ranks on one device (NCCL refuses
that). The embedded cluster hands the host's GPUs out instead (:func:`gpu_shares`): each node gets its own
slice, named to its raylet in ``CUDA_VISIBLE_DEVICES`` (Ray maps a worker's GPU slot through it), or, when
there are fewer GPUs than nodes, no node gets one and the workers run on CPU (:attr:`LocalCluster.gpu_note`
says so).

A SIGKILL of the service gives it no chance to stop the cluster: a small watchdog process (:mod:`.watchdog`) then
kills what Ray's own ties to the service leave running (each node's dashboard and runtime-env agents, ~60 s), and
removes the in-memory snapshot folders its workers kept.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass

import ray

from meridian.service.cluster import watchdog
from meridian.workers.distributed.ports import free_port
from meridian.workers.state.snapshot_paths import OWNER_FILE, every_snapshot_pattern

log = logging.getLogger(__name__)

# Measured on a 2-core host (RAY_NOTES.md): default health checks notice a dead node after ~17 s; these
# settings bring it to ~3 s.
FAST_FAILURE_DETECTION = {
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 1000,
    "health_check_initial_delay_ms": 1000,
}

NAMESPACE = "meridian"
"""The Ray namespace the service connects in; each job's runner actor is named there."""


def parse_datacenters(text: str) -> dict[str, int]:
    """``"dc-a:2,dc-b:2"`` → ``{"dc-a": 2, "dc-b": 2}`` (a bare name means one node)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = part.partition(":")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", name):
            raise ValueError(f"invalid datacenter name {name!r}: use letters, digits, '-', '_' or '.'")
        try:
            n = int(count or 1)
        except ValueError:
            raise ValueError(f"invalid node count {count!r} for datacenter {name!r}: expected an integer") from None
        if not 1 <= n <= 16:
            raise ValueError(f"datacenter {name!r}: node count must be between 1 and 16, got {n}")
        if name in out:
            raise ValueError(f"datacenter {name!r} is listed twice")
        out[name] = n
    if not out:
        raise ValueError("give at least one datacenter, e.g. dc-a:2,dc-b:2")
    return out


def host_gpu_ids() -> list[str]:
    """The GPUs this process may use, as Ray itself detects them: ``CUDA_VISIBLE_DEVICES`` when set, else every
    device NVML counts."""
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager as Nvidia

    visible = Nvidia.get_current_process_visible_accelerator_ids()
    return list(visible) if visible is not None else [str(i) for i in range(Nvidia.get_current_node_num_accelerators())]


def gpu_shares(gpu_ids: list[str], nodes: int) -> list[list[str]]:
    """Each of ``nodes`` simulated nodes' own GPUs: an equal slice each (the remainder unused), or none for every
    node when there are fewer GPUs than nodes (one GPU cannot host two NCCL ranks)."""
    share = len(gpu_ids) // nodes if nodes else 0
    return [gpu_ids[k * share:(k + 1) * share] for k in range(nodes)]


DASHBOARD_PORT = 8265
"""Ray's default dashboard port."""


def dashboard_port() -> int:
    """Ray's default dashboard port where it is free, else a free one (another Ray on this host holds it)."""
    return DASHBOARD_PORT if _port_is_free(DASHBOARD_PORT) else free_port()


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class LocalCluster:
    """A multi-node Ray cluster on this host; nodes are labelled with their simulated datacenter."""

    datacenters: dict[str, int]
    cpus_per_node: int = 1
    dashboard: bool = True

    def __post_init__(self) -> None:
        self._cluster = None
        self._watchdog = None
        self.gpu_note = ""
        """Why the nodes got no GPU although the host has some (empty otherwise)."""
        self.dashboard_port = 0
        """The Ray dashboard's port once started (Ray's default, or a free one where another Ray holds it)."""

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}" if self.dashboard and self.dashboard_port else ""

    def start(self) -> str:
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        host_gpus, nodes = host_gpu_ids(), sum(self.datacenters.values())
        shares = iter(gpu_shares(host_gpus, nodes))
        if host_gpus and len(host_gpus) < nodes:
            self.gpu_note = (f"this host has {len(host_gpus)} GPU(s) for {nodes} simulated nodes "
                             "and one GPU cannot host two ranks: the workers run on CPU (give as many nodes as GPUs, "
                             "e.g. --datacenters dc-a:1, to train on the GPU)")
            log.warning("embedded cluster: %s", self.gpu_note)
        if self._watchdog is None:  # before the first Ray process: it sees them all
            from ray._common.utils import get_default_ray_temp_dir

            self._watchdog = watchdog.start(get_default_ray_temp_dir(), every_snapshot_pattern(), OWNER_FILE)
        self.dashboard_port = dashboard_port()
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0, "num_gpus": 0, "include_dashboard": self.dashboard,
                "_system_config": FAST_FAILURE_DETECTION,
                **({"dashboard_port": self.dashboard_port} if self.dashboard else {}),
            },
        )
        for dc, count in self.datacenters.items():
            for _ in range(count):
                gpus = next(shares)
                self._cluster.add_node(num_cpus=self.cpus_per_node, num_gpus=len(gpus), labels={"datacenter": dc},
                                       **({"env_vars": {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}} if gpus else {}))
        self._cluster.wait_for_nodes()
        return self._cluster.address

    @property
    def cluster(self):  # the ray.cluster_utils.Cluster, for tests that remove nodes
        return self._cluster

    def shutdown(self) -> None:
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        watchdog.stop(self._watchdog)  # after the cluster: a SIGKILL during its shutdown is still covered
        self._watchdog = None


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (``None``: ``RAY_ADDRESS`` or a local ``ray start`` cluster)."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                 logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, ray.exceptions.AuthenticationError) as e:
        where = address or os.environ.get("RAY_ADDRESS") or "auto"
        raise ConnectionError(
            f"cannot reach a Ray cluster at {where}: {e}. Start one with `ray start --head --labels "
            f"datacenter=dc-a`, pass --address, or use --local-datacenters{_token_hint()}"
        ) from None


def _token_hint() -> str:
    """Why a running cluster may refuse this process: Ray's ``ray start --head`` turns token authentication on by
    itself where ``~/.ray/auth_token`` exists, and a process given an address does not follow (Ray then reports
    only a failed connection, after 20 s). Said when a token is at hand and token mode is off here."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return ""
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_file)):
        return ""
    return (f". If the cluster is up, it may use token authentication (`ray start --head` turns it on by itself "
            f"where {token_file} exists): start meridian with RAY_AUTH_MODE=token")
