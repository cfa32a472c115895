"""Who gets which namespace, device and address in the network lab: pure arithmetic, no system calls.

Every datacenter is a network namespace. Its nodes are addresses on the namespace's end of a veth pair
whose other end is in the host namespace (the management path to the Ray head, unshaped: a control plane
sits next to every datacenter). Datacenters reach each other only through a TUN device in each namespace,
whose packets a delay line (:mod:`meridian.lab.delay_line`) holds for the one-way delay and
hands to the destination datacenter's TUN; the kernel's ``tbf`` on each TUN sets the rate.

Addresses come from 198.18.0.0/15, the range RFC 2544 sets aside for network benchmarks, so they never
collide with a real network: the head is 198.18.0.1; datacenter ``i`` owns 198.18.(i+1).0/24, with the host
end of its veth at .1 and its nodes from .10.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEAD_IP = "198.18.0.1"
PREFIX = "mrd"
MAX_DATACENTERS = 200
FIRST_NODE_HOST = 10


@dataclass(frozen=True)
class LabNode:
    datacenter: str
    index: int
    """The node's index inside its datacenter."""
    ip: str


@dataclass(frozen=True)
class LabDatacenter:
    name: str
    index: int
    nodes: tuple[LabNode, ...]

    @property
    def netns(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def subnet(self) -> str:
        return f"198.18.{self.index + 1}.0/24"

    @property
    def gateway(self) -> str:
        """The host end of the management veth."""
        return f"198.18.{self.index + 1}.1"

    @property
    def host_veth(self) -> str:
        return f"{PREFIX}h{self.index}"

    @property
    def dc_veth(self) -> str:
        """The device inside the namespace that holds the nodes' addresses (``GLOO_SOCKET_IFNAME``)."""
        return f"{PREFIX}d{self.index}"

    @property
    def tun(self) -> str:
        """The inter-DC link's end inside the namespace; its counters are the link's bytes."""
        return f"{PREFIX}t{self.index}"


@dataclass(frozen=True)
class LinkSpec:
    rtt_ms: float
    gbps: float

    def __post_init__(self) -> None:
        if not 0 <= self.rtt_ms <= 10_000:
            raise ValueError(f"rtt_ms must be between 0 and 10000, got {self.rtt_ms}")
        if not 0.001 <= self.gbps <= 100:
            raise ValueError(f"gbps must be between 0.001 and 100, got {self.gbps}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2 / 1000


@dataclass(frozen=True)
class LabLayout:
    datacenters: tuple[LabDatacenter, ...]
    link: LinkSpec

    @classmethod
    def build(cls, datacenters: dict[str, int], link: LinkSpec) -> LabLayout:
        if not 1 <= len(datacenters) <= MAX_DATACENTERS:
            raise ValueError(f"the lab holds 1 to {MAX_DATACENTERS} datacenters, got {len(datacenters)}")
        dcs = []
        for i, (name, count) in enumerate(datacenters.items()):
            # a namespace's name, and the value of the nodes' Ray label, which must end with a letter or digit
            # (`ray start` refused `dc-` only after the network and the head were up)
            if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,29}[A-Za-z0-9])?", name):
                raise ValueError(f"datacenter name {name!r} cannot name a network namespace and a Ray label: use "
                                 "up to 31 letters, digits, '-', '_' or '.', starting and ending with a letter or "
                                 "digit")  # fmt: skip
            nodes = tuple(LabNode(name, k, f"198.18.{i + 1}.{FIRST_NODE_HOST + k}") for k in range(count))
            dcs.append(LabDatacenter(name, i, nodes))
        return cls(tuple(dcs), link)

    @property
    def nodes(self) -> tuple[LabNode, ...]:
        return tuple(n for dc in self.datacenters for n in dc.nodes)
