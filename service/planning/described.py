"""A cluster described in a file (``meridian plan --cluster CLUSTER.yaml``): datacenters of identical nodes and
the links between them, as typed frozen values, and the topology and hardware figures the planner takes from it.

Validation names the field of every bad value (``datacenters[1].node.gpu.memory_gb must be > 0, got -80``). Pure:
the caller parses the YAML (or JSON); nothing here reads a file, the clock or Ray.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, replace
from typing import Any

from meridian.service.cluster.topology import ClusterTopology, NodeInfo
from meridian.service.planning.cost_model import Figures, Link


class FieldError(ValueError):
    """A bad value in a cluster file: ``field`` names it (``datacenters[0].node.gpus``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


DEFAULT_NVLINK_LATENCY_US = 20.0
"""Per round of a collective inside a node where the file gives none: the planner's conservative default
(:func:`meridian.service.planning.planner.default_figures`)."""
DEFAULT_NIC_LATENCY_US = 50.0
"""Per round of a collective between the nodes of a datacenter where the file gives none (the same default)."""


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    name: str
    """The device's model name (``H100-SXM``): it selects the calibrated efficiency (:mod:`.calibration`)."""
    memory_gb: float
    """Device memory, GiB."""
    bf16_tflops: float
    """Dense bf16 peak, TFLOP/s (a datasheet figure): MFU divides by it."""
    efficiency: float | None = None
    """Sustained share of the peak on a transformer's compute; ``None``: the calibrated figure for ``name``."""


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    gpus: int
    cpus: int
    gpu: GpuSpec
    nvlink_gbps: float
    """One GPU's bandwidth to the others of its node, one direction, Gbit/s."""
    nic_gbps: float
    """The node's network bandwidth to the rest of its datacenter, one direction, Gbit/s (shared by its GPUs)."""
    nvlink_latency_us: float = DEFAULT_NVLINK_LATENCY_US
    nic_latency_us: float = DEFAULT_NIC_LATENCY_US


@dataclass(frozen=True, kw_only=True)
class DatacenterSpec:
    name: str
    nodes: int
    node: NodeSpec


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    between: tuple[str, str]
    rtt_ms: float
    gbps: float
    """The link's bandwidth in one direction, Gbit/s, shared by every rank of the two datacenters."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    datacenters: tuple[DatacenterSpec, ...]
    links: tuple[LinkSpec, ...] = ()

    def topology(self) -> ClusterTopology:
        """The cluster as the planner reads a live one: every node alive, labelled with its datacenter."""
        nodes = []
        for dc in self.datacenters:
            n = dc.node
            memory = float(n.gpus * n.gpu.memory_gb * 2**30)
            for i in range(dc.nodes):
                nodes.append(NodeInfo(node_id=f"{dc.name}-{i}", datacenter=dc.name, alive=True, address="", is_head=False,
                                      cpus=float(n.cpus), gpus=float(n.gpus), memory_bytes=memory,
                                      available_cpus=float(n.cpus), available_gpus=float(n.gpus),
                                      labels={"datacenter": dc.name}))
        return ClusterTopology(tuple(nodes))

    @property
    def slowest_gpu(self) -> GpuSpec:
        """The GPU of the datacenter whose devices compute slowest (what the planner plans for)."""
        return min((dc.node.gpu for dc in self.datacenters), key=lambda g: g.bf16_tflops * (g.efficiency or 1))

    def figures(self, efficiency: float) -> Figures:
        """The hardware figures of the slowest datacenter and link (the planner plans for the slowest), its devices
        sustaining ``efficiency`` of their peak (:func:`meridian.service.planning.calibration.calibrated_figures`)."""
        slow = min(self.datacenters, key=lambda dc: dc.node.gpu.bf16_tflops)
        small = min(self.datacenters, key=lambda dc: dc.node.gpu.memory_gb)
        nvlink = min(self.datacenters, key=lambda dc: dc.node.nvlink_gbps).node
        nic = min(self.datacenters, key=lambda dc: dc.node.nic_gbps / dc.node.gpus).node
        peak = slow.node.gpu.bf16_tflops * 1e12
        inter = min(self.links, key=lambda lk: lk.gbps) if self.links else None
        return Figures(
            device_flops=peak * efficiency, peak_flops=peak,
            device_memory_bytes=small.node.gpu.memory_gb * 2**30, device_memory_known=True, bf16_autocast=True,
            intra_node=Link(nvlink.nvlink_latency_us * 1e-6, nvlink.nvlink_gbps * 1e9 / 8),
            intra_dc=Link(nic.nic_latency_us * 1e-6, nic.nic_gbps / nic.gpus * 1e9 / 8),
            inter_dc=(Link(inter.rtt_ms / 2000, inter.gbps * 1e9 / 8) if inter
                      else Link(nic.nic_latency_us * 1e-6, nic.nic_gbps * 1e9 / 8)),
            inter_dc_known=inter is not None,
        )

    def one_datacenter(self) -> ClusterSpec:
        """The same nodes in one datacenter (named after the first): what ``--compare-one-dc`` plans."""
        first = self.datacenters[0]
        if any(dc.node != first.node for dc in self.datacenters):
            raise ValueError("--compare-one-dc needs every datacenter's nodes alike (datacenters[*].node); they differ")
        return ClusterSpec(datacenters=(replace(first, nodes=sum(dc.nodes for dc in self.datacenters)),))

    def with_inter_dc_gbps(self, gbps: float) -> ClusterSpec:
        """The same cluster with every inter-DC link at ``gbps``."""
        return replace(self, links=tuple(replace(lk, gbps=gbps) for lk in self.links))

    @property
    def gpus(self) -> int:
        return sum(dc.nodes * dc.node.gpus for dc in self.datacenters)


def cluster_from_dict(data: Any, where: str = "") -> ClusterSpec:
    """The :class:`ClusterSpec` of a parsed cluster file; ``ValueError`` naming the field of the first bad value
    (``where`` prefixes it, e.g. the file's name)."""
    root = _Obj(data, where.rstrip(".") + ":" if where else "", ("datacenters", "links"))
    dcs = []
    for i, raw in enumerate(root.items("datacenters", required=True)):
        d = _Obj(raw, f"{root.name}datacenters[{i}]", ("name", "nodes", "node"))
        n = _Obj(d.get("node", required=True), f"{d.name}.node",
                 ("gpus", "cpus", "gpu", "nvlink_gbps", "nic_gbps", "nvlink_latency_us", "nic_latency_us"))
        g = _Obj(n.get("gpu", required=True), f"{n.name}.gpu", ("name", "memory_gb", "bf16_tflops", "efficiency"))
        efficiency = g.number("efficiency", None)
        if efficiency is not None and not 0 < efficiency <= 1:
            raise FieldError(f"{g.name}.efficiency", f"must be in (0, 1] (a share of the peak), got {efficiency!r}")
        gpu = GpuSpec(name=g.text("name"), memory_gb=g.number("memory_gb"), bf16_tflops=g.number("bf16_tflops"),
                      efficiency=efficiency)
        node = NodeSpec(gpus=n.whole("gpus"), cpus=n.whole("cpus"), gpu=gpu, nvlink_gbps=n.number("nvlink_gbps"),
                        nic_gbps=n.number("nic_gbps"),
                        nvlink_latency_us=n.number("nvlink_latency_us", DEFAULT_NVLINK_LATENCY_US, ge=0),
                        nic_latency_us=n.number("nic_latency_us", DEFAULT_NIC_LATENCY_US, ge=0))
        if node.cpus < node.gpus:
            raise FieldError(f"{n.name}.cpus", f"({node.cpus}) must be >= its gpus ({node.gpus}): every GPU worker "
                             "takes a CPU too")
        dcs.append(DatacenterSpec(name=d.text("name"), nodes=d.whole("nodes"), node=node))
    names = [dc.name for dc in dcs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise FieldError(f"{root.name}datacenters[{i}].name", f"{name!r} names a datacenter twice")
    links, pairs = [], set()
    for i, raw in enumerate(root.items("links", required=False)):
        lk = _Obj(raw, f"{root.name}links[{i}]", ("between", "rtt_ms", "gbps"))
        between = lk.get("between", required=True)
        if (not isinstance(between, list) or len(between) != 2 or not all(isinstance(b, str) for b in between)
                or between[0] == between[1]):
            raise FieldError(f"{lk.name}.between", f"must name two different datacenters, got {reprlib.repr(between)}")
        unknown = [b for b in between if b not in names]
        if unknown:
            raise FieldError(f"{lk.name}.between", f"names {', '.join(map(repr, unknown))}, not a datacenter of the "
                             f"file ({', '.join(map(repr, names))})")
        pair = frozenset(between)
        if pair in pairs:
            raise FieldError(f"{lk.name}.between", f"{between} is given twice")
        pairs.add(pair)
        links.append(LinkSpec(between=(between[0], between[1]), rtt_ms=lk.number("rtt_ms", ge=0), gbps=lk.number("gbps")))
    unlinked = [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if frozenset((a, b)) not in pairs]
    if unlinked:
        a, b = unlinked[0]
        raise FieldError(f"{root.name}links", f"has no link between {a!r} and {b!r}; add "
                         f"{{between: [{a}, {b}], rtt_ms: ..., gbps: ...}}")
    return ClusterSpec(datacenters=tuple(dcs), links=tuple(links))


class _Obj:
    """Typed reads of one mapping of the file; a wrong value is a ``ValueError`` naming ``name.key``."""

    def __init__(self, data: Any, name: str, keys: tuple[str, ...]) -> None:
        self.name = name
        where = name or "the cluster file"
        if not isinstance(data, dict):
            raise FieldError(where, f"must be a mapping, got {type(data).__name__}")
        extra = sorted(set(map(str, data)) - set(keys))
        if extra:
            raise FieldError(self._key(extra[0]), f"is not a field here; the fields are {', '.join(keys)}")
        self.data = data

    def _key(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name and not self.name.endswith(":") else f"{self.name}{key}"

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        if key not in self.data or self.data[key] is None:
            if required:
                raise FieldError(self._key(key), "is missing")
            return default
        return self.data[key]

    def items(self, key: str, *, required: bool) -> list[Any]:
        value = self.get(key, [], required=required)
        if not isinstance(value, list) or (required and not value):
            raise FieldError(self._key(key), f"must be a non-empty list, got {reprlib.repr(value)}")
        return value

    def text(self, key: str) -> str:
        value = self.get(key, required=True)
        if not isinstance(value, str) or not value.strip():
            raise FieldError(self._key(key), f"must be a name, got {reprlib.repr(value)}")
        return value

    def whole(self, key: str) -> int:
        value = self.get(key, required=True)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FieldError(self._key(key), f"must be a whole number >= 1, got {reprlib.repr(value)}")
        return value

    def number(self, key: str, default: Any = ..., *, ge: float | None = None) -> Any:
        value = self.get(key, None if default is ... else default, required=default is ...)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise FieldError(self._key(key), f"must be a number, got {reprlib.repr(value)}")
        if (ge is None and value <= 0) or (ge is not None and value < ge):
            raise FieldError(self._key(key), f"must be {'> 0' if ge is None else f'>= {ge:g}'}, got {value!r}")
        return float(value)
