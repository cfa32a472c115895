"""``meridian lab``: the CLI of the network lab (:mod:`meridian.lab.lab`).

``up`` prints the Ray address to give ``meridian serve --address``; ``probe`` measures the inter-DC link
with real TCP; ``status`` shows what is up; ``down`` removes exactly what ``up`` made. Each takes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meridian.cli.errors import local_problem, report
from meridian.lab import delay_line


def add_lab_parser(sub: Any) -> None:
    lab = sub.add_parser("lab", help="a multi-datacenter Ray cluster on this machine over a real delayed link "
                                     "(needs root)", description="a multi-datacenter Ray cluster on this machine whose datacenters talk over real TCP through a link with the given delay and rate (needs root)")  # fmt: skip
    lsub = lab.add_subparsers(dest="lab_verb", required=True, metavar="ACTION")

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        sp = lsub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument("--name", default="lab", help="which lab (default: lab)")
        return sp

    up = action("up", "create the namespaces, the delayed link and a labelled Ray cluster; print its address")
    up.add_argument("--datacenters", default="dc-a:2,dc-b:2", metavar="DC:N,...")
    up.add_argument("--rtt-ms", type=float, default=21.0, help="round-trip time between datacenters (default 21)")
    up.add_argument("--gbps", type=float, default=1.0, help="inter-DC rate in Gbit/s per direction (default 1)")
    up.add_argument("--cpus-per-node", type=int, default=1)
    up.add_argument("--mtu", type=int, default=9000, help="MTU of the inter-DC link (default 9000)")
    up.add_argument("--delay-line", choices=delay_line.KINDS, default="auto", help=delay_line.KINDS_HELP)
    up.set_defaults(run=cmd_lab_up)
    pr = action("probe", "measure each inter-DC link with real TCP: RTT and bulk throughput")
    pr.add_argument("--bulk-mb", type=float, default=64)
    pr.set_defaults(run=cmd_lab_probe)
    action("status", "show the lab's address, datacenters and live Ray nodes").set_defaults(run=cmd_lab_status)
    action("down", "stop the lab's Ray nodes and delay line; delete its namespaces and devices").set_defaults(
        run=cmd_lab_down)


def _emit(args: argparse.Namespace, data: Any, text: str) -> int:
    print(json.dumps(data, indent=2) if args.json else text)
    return 0


def cmd_lab_up(args: argparse.Namespace) -> int:
    from meridian.lab import lab
    from meridian.service.cluster.connect import parse_datacenters

    state = lab.up(parse_datacenters(args.datacenters), rtt_ms=args.rtt_ms, gbps=args.gbps, name=args.name,
                   cpus_per_node=args.cpus_per_node, mtu=args.mtu, line=args.delay_line)  # fmt: skip
    s = state.summary()
    lines = [f"lab {s['name']!r} is up: {args.rtt_ms:g} ms RTT, {args.gbps:g} Gbit/s between datacenters "
             f"({s['delay_line']} delay line)"]
    if s.get("delay_line_note"):
        lines.append(f"  the Python delay line carries the link: {s['delay_line_note']}")
    lines += [f"  {dc['name']}: namespace {dc['netns']}, nodes {', '.join(dc['nodes'])}, link device {dc['link_device']}"
              for dc in s["datacenters"]]  # fmt: skip
    lines += [f"Ray address: {s['ray_address']}   dashboard: {s['dashboard']}", f"next: {s['serve']}"]
    return _emit(args, s, "\n".join(lines))


def cmd_lab_probe(args: argparse.Namespace) -> int:
    from meridian.lab import lab

    r = lab.probe(args.name, bulk_mb=args.bulk_mb)
    lines = [f"{x['src']} → {x['dst']}: RTT {x['rtt_ms']:.2f} ms (min {x['rtt_min_ms']:.2f}), "
             f"{x['gbps']:.3f} Gbit/s over {x['bulk_bytes'] / 2**20:.0f} MiB, link counted {x['link_tx_bytes']:,} B "
             f"in {x['link_tx_packets']:,} packets"
             for x in r["links"]]  # fmt: skip
    return _emit(args, r, "\n".join(lines) or "one datacenter: no inter-DC link to probe")


def cmd_lab_status(args: argparse.Namespace) -> int:
    from meridian.lab import lab

    s = lab.status(args.name)
    nodes = ", ".join(f"{n['ip']} ({n['labels'].get('datacenter', 'head')})" for n in s["alive_nodes"])
    line = "" if s["delay_line_running"] else (f"; its delay line is NOT running (see {s['delay_line_log']}): "
                                                "nothing crosses between datacenters")  # fmt: skip
    if not s["started"]:
        line += (f"; its `up` has not finished (still running, or interrupted: `meridian lab down --name "
                 f"{args.name}` removes what it made)")  # fmt: skip
    if s["ray_error"]:
        line += f"; {s['ray_error']}"
    return _emit(args, s, f"lab {args.name!r} at {s['ray_address']}: {len(s['alive_nodes'])} live nodes: {nodes}{line}")


def cmd_lab_down(args: argparse.Namespace) -> int:
    from meridian.lab import lab

    r = lab.down(args.name)
    text = (f"lab {args.name!r} removed: {r['ray_processes_stopped']} Ray processes stopped, namespaces "
            f"{', '.join(r['netns_removed']) or 'none'} deleted")  # fmt: skip
    if not r["problems"]:
        return _emit(args, r, text)
    # Part of the lab is left: an error like every verb's (`{"error": PROBLEM}` with --json), with what was removed.
    problem = local_problem("lab-down-incomplete", "Lab not wholly removed",
                            f"lab {args.name!r} was not wholly removed: {'; '.join(r['problems'])}; remove what is "
                            "left by hand (`ip netns del NAME`, `ip link del NAME`, `kill PID`)")  # fmt: skip
    if args.json:
        print(json.dumps({"error": problem, **r}, indent=2))
    else:
        print(text)
    print(f"error: {problem['detail']}", file=sys.stderr, flush=True)
    return 1


def run(args: argparse.Namespace) -> int:
    from meridian.lab.lab import InvalidLab, LabError

    as_json = bool(getattr(args, "json", False))
    try:
        return args.run(args)
    except InvalidLab as e:
        return report(as_json, local_problem("invalid-input", "Invalid input", str(e)), 2)
    except LabError as e:
        return report(as_json, local_problem("lab-error", "Lab error", str(e)), 1)
    except KeyboardInterrupt:  # an interrupted `up` removes what it made, unless interrupted again meanwhile
        detail = f"`meridian lab {args.lab_verb}` was interrupted"
        if args.lab_verb in ("up", "down"):
            left = lab_state_exists(args.name)
            detail += (f"; part of lab {args.name!r} is left: `meridian lab down --name {args.name}` removes it"
                       if left else f"; nothing of lab {args.name!r} is left")  # fmt: skip
        return report(as_json, local_problem("interrupted", "Interrupted", detail), 130)


def lab_state_exists(name: str) -> bool:
    from meridian.lab.lab import LabError, state_path

    try:
        return state_path(name).exists()
    except LabError:
        return False
