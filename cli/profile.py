"""``meridian profile ID``: ask ranks of a running job for a profiler trace of their next N steps, wait for the
traces and download them (``--list``: the job's traces so far). Each is Chrome trace JSON: open it in
https://ui.perfetto.dev or TensorBoard's profiler."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from meridian.api.client import TERMINAL_STATES, ApiError, Client
from meridian.cli.errors import CliError

WAIT_EVERY_S = 1.0


def add_profile_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="record a torch.profiler trace of a running job's next steps on some ranks",
                       description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--url", help="API base URL (default: $MERIDIAN_URL or http://127.0.0.1:8080)")
    p.add_argument("id", help="the job")
    p.add_argument("--steps", type=int, default=3, help="steps to record (default 3)")
    p.add_argument("--rank", type=int, action="append", help="a rank to record; repeatable (default: rank 0)")
    p.add_argument("--out", default=".", help="folder to download the traces to (default: here)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="wait at most S seconds for the traces (default 600); 0: do not wait or download")
    p.add_argument("--list", action="store_true", help="only list the job's traces so far")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, client: Client) -> int:
    if args.list:
        data = client.profiles(args.id)
        lines = [f"{t['id']}  rank {t['rank']:<4} {t['bytes'] / 1e6:8.2f} MB  {t['path']}" for t in data["traces"]]
        print(json.dumps(data, indent=2) if args.json else "\n".join(lines) or f"job {args.id} has no traces yet")
        return 0
    asked = client.profile(args.id, args.steps, args.rank or [0])
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    say(f"profile {asked['id']}: {asked['steps']} steps on ranks {asked['told']}"
        + (f" (ranks {asked['unreachable']} did not answer)" if asked["unreachable"] else ""))
    if args.timeout <= 0 or not asked["told"]:
        if args.json:
            print(json.dumps(asked))
        return 0 if asked["told"] else 1
    traces = _wait(client, args.id, asked, args.timeout)
    os.makedirs(args.out, exist_ok=True)
    files = []
    for t in traces:
        out = os.path.join(args.out, f"{args.id}-{t['id']}-rank-{t['rank']}.json")
        files.append({"rank": t["rank"], "file": out, "bytes": client.download(t["download"], out)})
        say(f"rank {t['rank']}: {out} ({files[-1]['bytes'] / 1e6:.2f} MB); open it in https://ui.perfetto.dev")
    if args.json:
        print(json.dumps({**asked, "files": files}))
    return 0


def _wait(client: Client, job_id: str, asked: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """The traces of request ``asked`` once every rank told has written its own."""
    deadline = time.monotonic() + timeout_s
    ended = False
    while True:
        traces = [t for t in client.profiles(job_id)["traces"] if t["id"] == asked["id"]]
        if {t["rank"] for t in traces} >= set(asked["told"]):
            return traces
        if ended:  # listed once more after the job's end: a rank writes what it has before its process ends
            raise CliError("profile-incomplete", "Profile incomplete",
                           f"job {job_id} ended before ranks "
                           f"{sorted(set(asked['told']) - {t['rank'] for t in traces})} wrote profile {asked['id']}; "
                           f"`meridian profile {job_id} --list` shows what was written")
        ended = client.job(job_id)["state"] in TERMINAL_STATES
        if time.monotonic() > deadline:
            raise ApiError(0, f"profile {asked['id']} of job {job_id}: not every rank wrote its trace within "
                              f"{timeout_s:.0f} s; `meridian profile {job_id} --list` shows what was written",
                           kind="profile-timeout")
        time.sleep(WAIT_EVERY_S)
