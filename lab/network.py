"""Create and remove the lab's namespaces, links, addresses, routes and rate limits with ``ip`` and ``tc``.

Everything made here is named from :mod:`meridian.lab.layout` (the ``mrd`` prefix) and
listed in the lab's state, so removal deletes exactly that: a namespace takes its veth end, TUN and qdisc
with it, and the host end of a veth goes with its peer. Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from meridian.lab.layout import HEAD_IP, LabDatacenter, LabLayout

Run = Callable[[list[str]], None]


class NetworkError(RuntimeError):
    """A command that builds or removes the lab's network failed; the message names it and what it said."""


def sh(cmd: list[str], timeout_s: float = 30.0) -> None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except OSError as e:
        raise NetworkError(f"`{cmd[0]}` could not run ({e.strerror or e}): the lab needs iproute2's `ip` and `tc` "
                           "on PATH") from None  # fmt: skip
    except subprocess.TimeoutExpired:
        raise NetworkError(f"`{' '.join(cmd)}` did not finish within {timeout_s:.0f} s") from None
    if out.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}")


def in_ns(netns: str, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", netns, *cmd]


def tbf_args(gbps: float) -> list[str]:
    """A token bucket at ``gbps`` with a burst of 2 ms of traffic (at least 64 KiB, so one 64 KiB TSO
    segment passes) and up to 100 ms of queue before it drops."""
    rate_bps = gbps * 1e9
    burst = max(64 * 1024, int(rate_bps / 8 * 0.002))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms"]


def datacenter_commands(dc: LabDatacenter, layout: LabLayout, mtu: int) -> list[list[str]]:
    ns = dc.netns
    cmds = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", dc.host_veth, "type", "veth", "peer", "name", dc.dc_veth, "netns", ns],
        ["ip", "addr", "add", f"{dc.gateway}/24", "dev", dc.host_veth],
        ["ip", "link", "set", dc.host_veth, "up"],
        in_ns(ns, ["ip", "link", "set", "lo", "up"]),
        *[in_ns(ns, ["ip", "addr", "add", f"{n.ip}/24", "dev", dc.dc_veth]) for n in dc.nodes],
        in_ns(ns, ["ip", "link", "set", dc.dc_veth, "up"]),
        in_ns(ns, ["ip", "route", "add", f"{HEAD_IP}/32", "via", dc.gateway, "dev", dc.dc_veth]),
        in_ns(ns, ["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"]),
        in_ns(ns, ["ip", "tuntap", "add", "dev", dc.tun, "mode", "tun"]),
        in_ns(ns, ["ip", "link", "set", dc.tun, "mtu", str(mtu), "up"]),
        in_ns(ns, ["tc", "qdisc", "add", "dev", dc.tun, "root", *tbf_args(layout.link.gbps)]),
    ]
    for other in layout.datacenters:
        if other is not dc:
            cmds.append(in_ns(ns, ["ip", "route", "add", other.subnet, "dev", dc.tun]))
    return cmds


def create(layout: LabLayout, made: Callable[[str, str], None], *, mtu: int, run: Run = sh) -> None:
    """Build the lab's network; ``made(kind, name)`` is told of each namespace or host device before the command
    that makes it runs, so a failure half-way, or a SIGKILL right after the command, still leaves a record of what
    to remove (removing one that was never made is quiet). The caller has checked that none of them exists."""
    for dc in layout.datacenters:
        for cmd in datacenter_commands(dc, layout, mtu):
            if cmd[:3] == ["ip", "netns", "add"]:
                made("netns", dc.netns)
            elif cmd[:3] == ["ip", "link", "add"]:
                made("link", dc.host_veth)
            run(cmd)
    first = layout.datacenters[0]
    run(["ip", "addr", "add", f"{HEAD_IP}/32", "dev", first.host_veth])


def remove(netns: list[str], links: list[str]) -> list[str]:
    """Delete what a lab made; returns what could not be removed (with why)."""
    problems = []
    for ns in netns:
        out = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30)
        if out.returncode != 0 and "No such file" not in out.stderr:
            problems.append(f"netns {ns}: {out.stderr.strip()}")
    for link in links:  # gone with its peer's namespace, unless the namespace never got it
        out = subprocess.run(["ip", "link", "del", link], capture_output=True, text=True, timeout=30)
        if out.returncode != 0 and "Cannot find device" not in out.stderr:
            problems.append(f"link {link}: {out.stderr.strip()}")
    return problems


def link_bytes(netns: str, device: str) -> dict[str, int]:
    """The kernel's counters of a device inside a namespace."""
    out = {}
    for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
        res = subprocess.run(in_ns(netns, ["cat", f"/sys/class/net/{device}/statistics/{key}"]),
                             capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
        out[key] = int(res.stdout.strip())
    return out
