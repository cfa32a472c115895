"""``meridian``: run the control plane, run the demo, and talk to the REST API.

Every verb that prints takes ``--json`` for scripts. Errors print the service's ``detail`` and exit 1
(2 for bad command-line usage), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from meridian.api import render
from meridian.api.client import ApiError, Client

TERMINAL = {"succeeded", "failed", "cancelled"}


def load_spec(path: str) -> dict[str, Any]:
    """A job spec from a JSON or YAML file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"cannot read job spec {path!r}: {e.strerror}") from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SystemExit(f"{path} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path} must hold one job spec object")
    return data


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def watch(client: Client, job_id: str, *, as_json: bool, timeout_s: float, interval_s: float = 0.5) -> dict[str, Any]:
    """Follow a job until it ends, printing a progress bar (or one JSON object per update)."""
    deadline = time.monotonic() + timeout_s
    tty = sys.stdout.isatty() and not as_json
    last_line, last_print = "", 0.0
    while True:
        job = client.job(job_id)
        line = render.progress_line(job)
        if as_json:
            if line != last_line:
                print(json.dumps({"id": job["id"], "state": job["state"], "progress": job["progress"]}), flush=True)
        elif tty:
            print("\r" + line.ljust(100)[:160], end="", flush=True)
        elif line != last_line and (time.monotonic() - last_print > 2 or job["state"] in TERMINAL):
            print(line, flush=True)
            last_print = time.monotonic()
        last_line = line
        if job["state"] in TERMINAL:
            if tty:
                print()
            return job
        if time.monotonic() > deadline:
            if tty:
                print()
            raise ApiError(0, f"job {job_id} still {job['state']} after {timeout_s:.0f} s "
                              f"({job['message']}); it keeps running — follow it with `meridian watch {job_id}`")
        time.sleep(interval_s)


# -- verbs -----------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from meridian.api.app import create_app
    from meridian.service.cluster import parse_datacenters
    from meridian.service.core import ServiceConfig

    local = parse_datacenters(args.local_datacenters) if args.local_datacenters else None
    config = ServiceConfig(data_dir=args.data_dir, database_url=args.database_url, ray_address=args.address,
                           local_datacenters=local, cpus_per_node=args.cpus_per_node)
    print(f"Meridian API on http://{args.host}:{args.port} (docs at /docs); data in {config.data_dir}", flush=True)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from meridian.api.server import serve_in_thread
    from meridian.service.cluster import parse_datacenters
    from meridian.service.core import MeridianService, ServiceConfig

    dcs = parse_datacenters(args.datacenters)
    spec = load_spec(args.spec)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    say(f"Starting an embedded Ray cluster: {', '.join(f'{dc} × {n} nodes' for dc, n in dcs.items())} "
        "(plus a head node); this takes ~20 s …")
    t0 = time.monotonic()
    service = MeridianService(ServiceConfig(data_dir=args.data_dir, local_datacenters=dcs)).start()
    try:
        with serve_in_thread(service, host="127.0.0.1", port=args.port) as url:
            client = Client(url)
            say(f"Cluster up in {time.monotonic() - t0:.0f} s. Ray dashboard: http://127.0.0.1:8265  API: {url}/docs")
            say(render.cluster_view(client.cluster()))
            job = client.submit(spec)
            say(f"\nSubmitted {args.spec} as job {job['id']} over POST {url}/v1/jobs\n{job['plan']['explanation']}")
            t1 = time.monotonic()
            job = watch(client, job["id"], as_json=args.json, timeout_s=args.timeout)
            if args.json:
                print(json.dumps(job, indent=2))
            else:
                print("\n" + render.summary(job, wall_s=time.monotonic() - t1))
            return 0 if job["state"] == "succeeded" else 1
    finally:
        say("Stopping the embedded cluster …")
        service.stop()


def cmd_submit(args: argparse.Namespace, client: Client) -> int:
    job = client.submit(load_spec(args.file), idempotency_key=args.idempotency_key)
    if args.watch:
        job = watch(client, job["id"], as_json=args.json, timeout_s=args.timeout)
        emit(args, job, render.summary(job))
        return 0 if job["state"] == "succeeded" else 1
    emit(args, job, f"submitted job {job['id']} ({job['state']}): {job['plan']['explanation'] if job['plan'] else ''}")
    return 0


def cmd_ls(args: argparse.Namespace, client: Client) -> int:
    params = {"state": args.state} if args.state else {}
    data = client.jobs(**params, limit=args.limit)
    emit(args, data, render.job_table(data["jobs"]) if data["jobs"] else "no jobs")
    return 0


def cmd_get(args: argparse.Namespace, client: Client) -> int:
    job = client.job(args.id)
    emit(args, job, render.summary(job) + "\n" + render.progress_line(job))
    return 0


def cmd_watch(args: argparse.Namespace, client: Client) -> int:
    job = watch(client, args.id, as_json=args.json, timeout_s=args.timeout)
    if not args.json:
        print(render.summary(job))
    return 0 if job["state"] == "succeeded" else 1


def cmd_cancel(args: argparse.Namespace, client: Client) -> int:
    job = client.cancel(args.id)
    emit(args, job, f"job {job['id']}: {job['state']} — {job['message']}")
    return 0


def cmd_cluster(args: argparse.Namespace, client: Client) -> int:
    data = client.cluster()
    emit(args, data, render.cluster_view(data))
    return 0


def cmd_plan(args: argparse.Namespace, client: Client) -> int:
    plan = client.plan(load_spec(args.file))
    emit(args, plan, json.dumps(plan, indent=2))
    return 0


def cmd_events(args: argparse.Namespace, client: Client) -> int:
    data = client.events(args.id, after=args.after)
    text = "\n".join(f"{e['id']:>6}  {time.strftime('%H:%M:%S', time.localtime(e['time']))}  {e['kind']:<16} {e['message']}"
                     for e in data["events"])
    emit(args, data, text or "no events")
    return 0


# -- parser ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meridian", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help_: str, *, remote: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        if remote:
            sp.add_argument("--url", help="API base URL (default: $MERIDIAN_URL or http://127.0.0.1:8080)")
        return sp

    s = verb("serve", "run the control plane (REST API + scheduler) until interrupted", remote=False)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or a local `ray start`)")
    s.add_argument("--local-datacenters", default=None, metavar="DC:N,...",
                   help="start an embedded cluster instead, e.g. dc-a:2,dc-b:2 (stopped with the service)")
    s.add_argument("--cpus-per-node", type=int, default=1, help="CPUs of each embedded node (default 1)")
    s.add_argument("--data-dir", default=os.path.expanduser("~/.meridian"), help="database, checkpoints, run folders")
    s.add_argument("--database-url", default="", help="SQLAlchemy URL of the job store (default: SQLite in --data-dir)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(run=cmd_serve)

    d = verb("demo", "start a local 2-datacenter cluster, submit the example job over REST, watch it", remote=False)
    d.add_argument("--datacenters", default="dc-a:2,dc-b:2", metavar="DC:N,...")
    d.add_argument("--spec", default=str(Path(__file__).resolve().parents[1] / "examples" / "demo.json"))
    d.add_argument("--data-dir", default=".meridian")
    d.add_argument("--port", type=int, default=0, help="API port (default: any free port)")
    d.add_argument("--timeout", type=float, default=900, help="give up watching after this many seconds")
    d.set_defaults(run=cmd_demo)

    s = verb("submit", "submit a job spec (JSON or YAML)")
    s.add_argument("file")
    s.add_argument("--watch", action="store_true", help="follow the job until it ends")
    s.add_argument("--idempotency-key", default=None, help="resubmitting with the same key returns the same job")
    s.add_argument("--timeout", type=float, default=3600)
    s.set_defaults(run=cmd_submit)

    s = verb("ls", "list jobs, newest first")
    s.add_argument("--state", action="append", choices=["queued", "placing", "running", "succeeded", "failed", "cancelled"])
    s.add_argument("--limit", type=int, default=50)
    s.set_defaults(run=cmd_ls)

    for name, fn, help_ in (("get", cmd_get, "show one job"), ("cancel", cmd_cancel, "cancel a job")):
        s = verb(name, help_)
        s.add_argument("id")
        s.set_defaults(run=fn)

    s = verb("watch", "follow a job with a live progress bar until it ends")
    s.add_argument("id")
    s.add_argument("--timeout", type=float, default=24 * 3600)
    s.set_defaults(run=cmd_watch)

    s = verb("events", "list a job's events")
    s.add_argument("id")
    s.add_argument("--after", type=int, default=0)
    s.set_defaults(run=cmd_events)

    verb("cluster", "show datacenters, nodes and resources").set_defaults(run=cmd_cluster)

    s = verb("plan", "dry-run the planner for a job spec")
    s.add_argument("file")
    s.set_defaults(run=cmd_plan)

    b = sub.add_parser("bench", help="benchmarks (sync, scaling, …); see `meridian bench -h`", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(run=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from meridian.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.verb in ("serve", "demo"):
            return args.run(args)
        client = Client(args.url)
        try:
            return args.run(args, client)
        finally:
            client.close()
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
