"""``meridian token create | list | revoke``: the bearer tokens of a service with auth on.

They edit the token file the service reads (only hashes are in it); a running service sees a change within
half a second, so a revoked token is refused without a restart."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def default_token_file() -> str:
    # Same default as meridian.api.auth, without importing the server side into every CLI call.
    return os.environ.get("MERIDIAN_TOKEN_FILE") or os.path.expanduser("~/.meridian/tokens.json")


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``30d`` → seconds."""
    unit = text[-1:].lower()
    try:
        value = float(text[:-1]) if unit in DURATION_UNITS else float(text)
    except ValueError:
        raise ValueError(f"--expires-in {text!r}: give a number with s, m, h or d, e.g. 30d") from None
    seconds = value * DURATION_UNITS.get(unit, 1)
    if seconds <= 0:
        raise ValueError(f"--expires-in {text!r} must be more than 0")
    return seconds


def add_token_parser(sub: Any) -> None:
    t = sub.add_parser("token", help="manage API tokens", description="manage API tokens")
    tsub = t.add_subparsers(dest="token_verb", required=True, metavar="ACTION")
    tc = tsub.add_parser("create", help="print a new bearer token for an owner; store only its hash")
    tc.add_argument("--owner", required=True, help="who the token acts for (jobs are owned by this name)")
    tc.add_argument("--expires-in", default=None, metavar="DURATION", help="refuse it after this long (30d, 12h, ...)")
    tc.add_argument("--admin", action="store_true", help="its caller sees every owner's jobs and sets quotas")
    tc.set_defaults(run=cmd_create)
    tl = tsub.add_parser("list", help="the tokens in the token file: id, owner, created, expiry (never the token)")
    tl.set_defaults(run=cmd_list)
    tr = tsub.add_parser("revoke", help="remove a token; a running service refuses it within a second")
    tr.add_argument("id", help="the token's id from `meridian token list` (a unique prefix will do)")
    tr.set_defaults(run=cmd_revoke)
    for p in (tc, tl, tr):
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--token-file", default=default_token_file(), help="token hashes (default: "
                       "$MERIDIAN_TOKEN_FILE or ~/.meridian/tokens.json)")


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "never"


def _entry(e: Any) -> dict[str, Any]:
    return {"id": e.id, "owner": e.owner, "admin": e.admin, "created_at": e.created_at, "expires_at": e.expires_at,
            "expired": not e.valid_at(time.time())}


def cmd_create(args: argparse.Namespace) -> int:
    from meridian.api.auth import create_token

    expires = parse_duration(args.expires_in) if args.expires_in else None
    token = create_token(args.token_file, args.owner, expires_in_s=expires, admin=args.admin)
    data = {"owner": args.owner, "token": token, "token_file": args.token_file, "admin": args.admin,
            "expires_at": time.time() + expires if expires else None}
    print(json.dumps(data, indent=2) if args.json else
          f"{token}\n(owner {args.owner}{', admin' if args.admin else ''}; expires {_when(data['expires_at'])}; only "
          f"its hash is stored in {args.token_file}. It is shown once: keep it in MERIDIAN_TOKEN. A running service "
          "accepts it within a second.)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from meridian.api.auth import read_tokens

    entries = [_entry(e) for e in read_tokens(args.token_file)]
    if args.json:
        print(json.dumps({"tokens": entries, "token_file": args.token_file}, indent=2))
        return 0
    lines = [f"{'id':<13} {'owner':<20} {'created':<17} {'expires':<17}"]
    lines += [f"{e['id']:<13} {e['owner'] + (' (admin)' if e['admin'] else ''):<20} {_when(e['created_at']):<17} "
              f"{_when(e['expires_at']):<17}{'  expired' if e['expired'] else ''}" for e in entries]
    print("\n".join(lines) if entries else f"no tokens in {args.token_file}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from meridian.api.auth import revoke_token

    gone = revoke_token(args.token_file, args.id)
    print(json.dumps({"revoked": _entry(gone)}, indent=2) if args.json else
          f"revoked token {gone.id} of {gone.owner}; a running service refuses it within a second")
    return 0
