"""``meridian quota set | list``: what each owner's jobs may hold at once (an admin's token with auth on)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_quota_parser(sub: Any) -> None:
    q = sub.add_parser("quota", help="per-owner quotas: CPUs, GPUs, concurrent jobs",
                       description="per-owner quotas: CPUs, GPUs, concurrent jobs")
    qsub = q.add_subparsers(dest="quota_verb", required=True, metavar="ACTION")
    s = qsub.add_parser("set", help="set an owner's quota (admins only); an option left out means no limit")
    s.add_argument("owner")
    s.add_argument("--cpus", type=float, default=None)
    s.add_argument("--gpus", type=float, default=None)
    s.add_argument("--jobs", type=int, default=None, help="jobs placing or running at once")
    s.set_defaults(run=cmd_set)
    ls = qsub.add_parser("list", help="every owner's quota (an admin) or your own")
    ls.set_defaults(run=cmd_list)
    for p in (s, ls):
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--url", help="API base URL (default: $MERIDIAN_URL or http://127.0.0.1:8080)")


def _line(q: dict[str, Any]) -> str:
    def limit(v: Any) -> str:
        return "no limit" if v is None else f"{v:g}"

    return f"{q['owner'] or '(anonymous)'}: cpus {limit(q['cpus'])}, gpus {limit(q['gpus'])}, jobs {limit(q['jobs'])}"


def cmd_set(args: argparse.Namespace, client: Any) -> int:
    q = client.request("PUT", f"/v1/quotas/{args.owner}", json={"cpus": args.cpus, "gpus": args.gpus, "jobs": args.jobs})
    print(json.dumps(q, indent=2) if args.json else _line(q))
    return 0


def cmd_list(args: argparse.Namespace, client: Any) -> int:
    data = client.request("GET", "/v1/quotas")
    print(json.dumps(data, indent=2) if args.json else "\n".join(_line(q) for q in data["quotas"]) or "no quotas set")
    return 0
