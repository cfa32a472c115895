"""``meridian``: run the control plane, run the demo, and talk to the REST API.

Every verb that prints takes ``--json`` for scripts. Errors print the service's ``detail`` on stderr and exit 1
(2 for bad input or command-line usage), never a traceback; with ``--json`` they also print ``{"error": PROBLEM}``
on stdout, the service's RFC 9457 problem or one of its shape (:mod:`meridian.cli.errors`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from meridian.api.client import TERMINAL_STATES as TERMINAL
from meridian.api.client import ApiError, Client
from meridian.cli import render
from meridian.cli.data import add_data_parser
from meridian.cli.data import run as run_data
from meridian.cli.errors import CliError, local_problem, report
from meridian.cli.export import add_export_parser
from meridian.cli.lab import add_lab_parser
from meridian.cli.lab import run as run_lab
from meridian.cli.plan import add_plan_parser
from meridian.cli.profile import add_profile_parser
from meridian.cli.quota import add_quota_parser
from meridian.cli.tokens import add_token_parser, default_token_file
from meridian.workers.contracts.events import EventKind


def _spec_error(detail: str) -> CliError:
    return CliError("invalid-spec-file", "Invalid job spec file", detail, exit_code=2)


def load_spec(path: str) -> dict[str, Any]:
    """A job spec from a JSON or YAML file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise _spec_error(f"cannot read job spec {path!r}: {e.strerror}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise _spec_error(f"{path}: reading YAML needs PyYAML (`pip install pyyaml`); or give the spec as JSON") from None

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise _spec_error(f"{path} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise _spec_error(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _spec_error(f"{path} must hold one job spec object")
    return data


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def watch(client: Client, job_id: str, *, as_json: bool, timeout_s: float | None,
          interval_s: float = 0.5) -> dict[str, Any]:
    """Follow a job until it ends, printing a progress bar (or one JSON object per update): over the job's event
    stream (its ``state`` and ``progress`` events, resumed after the last one seen), reading the job itself only at
    the start, at the end, and every ``interval_s`` while the stream is down. With ``timeout_s``, give up after that
    many seconds (the job keeps running), else follow it however long it runs."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def expired() -> bool:
        return deadline is not None and time.monotonic() > deadline
    tty = sys.stdout.isatty() and not as_json
    shown = {"line": "", "at": 0.0}

    def show(job: dict[str, Any]) -> None:
        line = render.progress_line(job)
        if as_json:
            line += job["state"]  # a state that changes alone is an update too (the bar reads the same at the end)
            if line != shown["line"]:
                print(json.dumps({"id": job["id"], "state": job["state"], "progress": job["progress"]}), flush=True)
        elif tty:
            print("\r" + line.ljust(100)[:160], end="", flush=True)
        elif line != shown["line"] and (time.monotonic() - shown["at"] > 2 or job["state"] in TERMINAL):
            print(line, flush=True)
            shown["at"] = time.monotonic()
        shown["line"] = line

    def timed_out(job: dict[str, Any]) -> ApiError:
        if tty:
            print()
        return ApiError(0, f"job {job_id} still {job['state']} after {timeout_s:.0f} s ({job['message']}); "
                           f"it keeps running — follow it with `meridian watch {job_id}`", kind="watch-timeout")

    job = client.job(job_id)
    newest = client.events(job_id, newest=1)["events"]
    after = newest[-1]["id"] if newest else 0
    while True:
        show(job)
        if job["state"] in TERMINAL:
            if tty:
                print()
            return job
        if expired():
            raise timed_out(job)
        try:
            for e in client.stream_events(job_id, after=after, reconnects=0):
                after = e["id"]
                if e["kind"] == EventKind.PROGRESS:
                    job = {**job, "progress": {**job["progress"], **e["data"]}}
                elif e["kind"] == EventKind.STATE:
                    job = {**job, "state": e["data"]["state"], "reason": e["data"]["reason"],
                           "message": e["data"]["message"]}
                show(job)
                if expired():
                    raise timed_out(job)
        except ApiError as e:
            if e.status or e.problem.get("type", "").endswith("watch-timeout"):
                raise  # the service refused (or the wait is over): not a dropped stream
            time.sleep(interval_s)  # the stream dropped: read the job meanwhile, then resume after `after`
        job = client.job(job_id)  # the stream ended (the job did) or dropped: the job as stored


SUMMARY_EVENT_PAGES = 50
"""A summary reads at most this many pages of a job's events for its sync decisions."""


def summary(client: Client, job: dict[str, Any], wall_s: float | None = None) -> str:
    """The job's summary, with what an armed look-ahead decided (its ``sync_decided`` events), if it did; for the
    text output only (``--json`` prints the job as the API returned it)."""
    decided: list[str] = []
    after = 0
    for _ in range(SUMMARY_EVENT_PAGES):  # a re-formed epoch decides again, maybe thousands of events later
        page = client.events(job["id"], after=after)["events"]
        if not page:
            break
        decided += [e["message"] for e in page if e["kind"] == EventKind.SYNC_DECIDED]
        after = page[-1]["id"]
    return render.summary(job, wall_s=wall_s, sync_decisions=tuple(decided))


def _port_taken(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port``. Checked before the service starts: uvicorn's own bind
    error came only after an embedded cluster's ~20 s start, and after the line that says where the API listens.
    Other bind errors (no such address, a privileged port) are left to uvicorn to report."""
    if port == 0:
        return False
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


# -- verbs -----------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from meridian.api.app import create_app
    from meridian.api.auth import AuthSettings, UnsafeDeployment, check_bind, is_loopback
    from meridian.api.server import Server
    from meridian.service.cluster.connect import parse_datacenters
    from meridian.service.core import MeridianService, ServiceConfig, StorageUnusable
    from meridian.service.lease import DatabaseOwned

    def refused(e: Exception) -> CliError:
        return CliError("serve-refused", "The service did not start", str(e), exit_code=2)

    try:
        # Auth is forced on for any non-loopback bind; with no tokens there the service refuses to start.
        auth = AuthSettings.load(enabled=args.auth or not is_loopback(args.host), token_file=args.token_file)
        check_bind(args.host, auth)
        local = parse_datacenters(args.local_datacenters) if args.local_datacenters else None
        config = ServiceConfig(data_dir=args.data_dir, database_url=args.database_url, ray_address=args.address,
                               local_datacenters=local, cpus_per_node=args.cpus_per_node,
                               data_roots=tuple(args.data_root or ()), storage=args.storage,
                               tracking_roots=tuple(args.tracking_root or ()),
                               model_modules=tuple(args.model_module or ()),
                               **({} if args.max_relaunches is None else {"max_relaunches": args.max_relaunches}))
        if args.max_streams_per_owner is not None and args.max_streams_per_owner < 1:
            raise ValueError(f"--max-streams-per-owner must be at least 1, got {args.max_streams_per_owner}")
        if _port_taken(args.host, args.port):
            raise ValueError(f"port {args.port} on {args.host} is in use (another `meridian serve`, or any other "
                             f"program); start this one with --port N and point the CLI at it with "
                             f"MERIDIAN_URL=http://{args.host}:N")
    except (UnsafeDeployment, ValueError) as e:
        raise refused(e) from None
    who = f"auth on, {len(auth.hashes)} token(s) from {auth.token_file}" if auth.enabled else "auth off (loopback only)"
    # Started here, in the main thread, not in the app's lifespan (a worker thread): an embedded cluster
    # installs signal handlers, which Python allows only in the main thread.
    try:
        service = MeridianService(config).start()
    except (DatabaseOwned, StorageUnusable) as e:
        raise refused(e) from None
    try:
        started = {"url": f"http://{args.host}:{args.port}", "docs": f"http://{args.host}:{args.port}/docs",
                   "data_dir": config.data_dir, "checkpoints": config.checkpoint_root,
                   "data_roots": list(config.effective_data_roots), "auth": auth.enabled,
                   "token_file": auth.token_file if auth.enabled else None}
        emit(args, started, f"Meridian API on {started['url']} (docs at /docs); data in {config.data_dir}; "
                            f"checkpoints and weights in {config.checkpoint_root}; "
                            f"job data from {', '.join(config.effective_data_roots)}; {who}")
        sys.stdout.flush()
        # lifespan "off": this function starts and stops the service, so the app's lifespan has nothing to do; and
        # uvicorn's lifespan task, cancelled by a second Ctrl-C during the shutdown, logged an ERROR traceback.
        app = create_app(config, auth=auth, service=service, **(
            {"max_streams_per_owner": args.max_streams_per_owner} if args.max_streams_per_owner is not None else {}))
        server = Server(uvicorn.Config(app, host=args.host,
                                       port=args.port, log_level=args.log_level, lifespan="off"))
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the Ctrl-C it caught once it has stopped
            server.run()
    finally:
        service.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from meridian.api.server import serve_in_thread
    from meridian.service.cluster.connect import parse_datacenters
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
            dashboard = service.local_cluster.dashboard_url if service.local_cluster is not None else ""
            say(f"Cluster up in {time.monotonic() - t0:.0f} s. Ray dashboard: {dashboard or 'off'}  API: {url}/docs")
            say(render.cluster_view(client.cluster()))
            if service.local_cluster is not None and service.local_cluster.gpu_note:
                say(f"Note: {service.local_cluster.gpu_note}")
            job = client.submit(spec)
            say(f"\nSubmitted {args.spec} as job {job['id']} over POST {url}/v1/jobs\n{render.plan_block(job['plan'])}")
            t1 = time.monotonic()
            job = watch(client, job["id"], as_json=args.json, timeout_s=args.timeout)
            if args.json:
                print(json.dumps(job, indent=2))
            else:
                print("\n" + summary(client, job, wall_s=time.monotonic() - t1))
            return 0 if job["state"] == "succeeded" else 1
    finally:
        say("Stopping the embedded cluster …")
        service.stop()


def cmd_submit(args: argparse.Namespace, client: Client) -> int:
    job = client.submit(load_spec(args.file), idempotency_key=args.idempotency_key)
    if args.watch:
        job = watch(client, job["id"], as_json=args.json, timeout_s=args.timeout)
        emit(args, job, "" if args.json else summary(client, job))
        return 0 if job["state"] == "succeeded" else 1
    emit(args, job, f"submitted job {job['id']} ({job['state']})" + (f"\n{render.plan_block(job['plan'])}" if job['plan'] else ""))
    return 0


def cmd_ls(args: argparse.Namespace, client: Client) -> int:
    params = {"state": args.state} if args.state else {}
    data = client.jobs(**params, limit=args.limit)
    emit(args, data, render.job_table(data["jobs"]) if data["jobs"] else "no jobs")
    return 0


def cmd_get(args: argparse.Namespace, client: Client) -> int:
    job = client.job(args.id)
    emit(args, job, "" if args.json else summary(client, job) + "\n" + render.progress_line(job))
    return 0


def cmd_watch(args: argparse.Namespace, client: Client) -> int:
    job = watch(client, args.id, as_json=args.json, timeout_s=args.timeout)
    if not args.json:
        print(summary(client, job))
    return 0 if job["state"] == "succeeded" else 1


def cmd_cancel(args: argparse.Namespace, client: Client) -> int:
    job = client.cancel(args.id)
    emit(args, job, f"job {job['id']}: {job['state']} — {job['message']}")
    return 0


def cmd_cluster(args: argparse.Namespace, client: Client) -> int:
    data = client.cluster()
    emit(args, data, render.cluster_view(data))
    return 0


def cmd_probe(args: argparse.Namespace, client: Client) -> int:
    if args.compute:
        data = client.probe_compute(load_spec(args.compute))
        emit(args, data, render.compute_probe_view(data))
        return 0
    data = client.probe_links(args.tiers, int(args.max_mb * 2**20))
    emit(args, data, render.probe_view(data))
    return 0


def _event_line(e: dict[str, Any]) -> str:
    return f"{e['id']:>6}  {time.strftime('%H:%M:%S', time.localtime(e['time']))}  {e['kind']:<16} {e['message']}"


def _earlier_note(n: int) -> str:
    return f"({n} earlier events not shown: --tail N shows the last N, up to 10000; --after ID those after an event)"


def cmd_events(args: argparse.Namespace, client: Client) -> int:
    data = client.events(args.id, after=args.after, newest=args.tail or None)
    if args.follow:  # the last --tail events, then live from there: a long job's history is not replayed
        if data.get("earlier") and not args.json:
            print(_earlier_note(data["earlier"]), flush=True)
        after = args.after
        for e in data["events"]:
            print(json.dumps(e) if args.json else _event_line(e), flush=True)
            after = e["id"]
        for e in client.stream_events(args.id, after=after):
            print(json.dumps(e) if args.json else _event_line(e), flush=True)
        return 0
    lines = [_event_line(e) for e in data["events"]]
    if data.get("earlier"):
        lines.insert(0, _earlier_note(data["earlier"]))
    emit(args, data, "\n".join(lines) or "no events")
    return 0


def cmd_logs(args: argparse.Namespace, client: Client) -> int:
    params: dict[str, Any] = {"tail_kb": args.tail_kb}
    if args.rank is not None:
        params["rank"] = args.rank
    def show(entry: dict[str, Any]) -> None:
        print(json.dumps(entry) if args.json else f"rank {entry['rank']} {entry['stream']}| {entry['line']}", flush=True)
    if args.follow:
        for entry in client.follow_logs(args.id, **params):
            show(entry)
        return 0
    data = client.logs(args.id, **params)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for entry in data["lines"]:
            show(entry)
        if not data["lines"]:
            print("no log lines yet (the job has no running workers, or they printed nothing)")
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
    s.add_argument("--data-root", action="append", metavar="PATH_OR_URL",
                   help="a folder whose files jobs may train on (data.source, data.dataset), or a URL prefix such as "
                        "s3://bucket/prefix under which data.dataset may name prepared datasets (each node copies "
                        "them into its cache); repeatable (default: DATA_DIR/data)")
    s.add_argument("--tracking-root", action="append", metavar="PATH_OR_URL",
                   help="a folder where jobs may keep an MLflow store (tracking.mlflow.uri file:... or sqlite:...), "
                        "or an https:// MLflow server they may log to; repeatable (default: DATA_DIR/tracking)")
    s.add_argument("--model-module", action="append", metavar="PKG",
                   help="a module whose factories jobs may name as model.factory (module:function); repeatable")
    s.add_argument("--storage", default="", metavar="PATH_OR_URL",
                   help="where checkpoints and final weights go: a path every node and the service can read and "
                        "write (a shared filesystem), or an fsspec URL such as s3://bucket/prefix, credentials "
                        "from the environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) (default: "
                        "DATA_DIR/checkpoints)")
    s.add_argument("--max-relaunches", type=int, default=None, metavar="N",
                   help="times a job whose runner actor is lost (its node died, the Ray cluster restarted) is "
                        "queued again to run from its newest checkpoint before it fails (default: 3; 0: it fails "
                        "at once)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--auth", action="store_true", help="require bearer tokens (always on for a non-loopback --host)")
    s.add_argument("--max-streams-per-owner", type=int, default=None, metavar="N",
                   help="event streams and followed logs one owner may hold open at once; one more is a 429 "
                        "(default: 32, api.streams.DEFAULT_MAX_STREAMS_PER_OWNER)")
    s.add_argument("--token-file", default=default_token_file(), help="token hashes (default: $MERIDIAN_TOKEN_FILE "
                   "or ~/.meridian/tokens.json)")
    s.set_defaults(run=cmd_serve)

    add_token_parser(sub)

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
    s.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="with --watch: stop following after S seconds, exit 1 (the job keeps running); default: "
                        "follow until the job ends")
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
    s.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop following after S seconds, exit 1 (the job keeps running); default: until it ends")
    s.set_defaults(run=cmd_watch)

    s = verb("events", "list a job's last 1000 events (-f: then follow them live until the job ends)")
    s.add_argument("id")
    s.add_argument("--after", type=int, default=0, help="only events with a larger id")
    s.add_argument("--tail", type=int, default=1000, metavar="N",
                   help="the last N events (after --after), up to 10000 (default 1000), earlier ones counted; 0: from "
                        "--after on instead (the first 1000, or with -f every event)")
    s.add_argument("-f", "--follow", action="store_true")
    s.set_defaults(run=cmd_events)

    s = verb("logs", "print a job's worker logs (-f: follow them until the job ends)")
    s.add_argument("id")
    s.add_argument("-f", "--follow", action="store_true")
    s.add_argument("--rank", type=int, action="append", help="only this rank; repeat for several")
    s.add_argument("--tail-kb", type=int, default=64, help="start this many kB before the end of each log")
    s.set_defaults(run=cmd_logs)

    verb("cluster", "show datacenters, nodes and resources").set_defaults(run=cmd_cluster)

    add_export_parser(verb)

    s = verb("probe", "measure the cluster's links with collectives (10-60 s); later plans use the figures")
    s.add_argument("--tiers", nargs="+", choices=["intra_node", "intra_dc", "inter_dc"], default=None,
                   help="which links (default: every tier the cluster has)")
    s.add_argument("--max-mb", type=float, default=64.0, help="largest message in MiB (default 64)")
    s.add_argument("--compute", metavar="JOB_FILE",
                   help="instead of the links: measure forward + backward of this job's model and micro-batch on "
                        "every worker slot (seconds); later plans of that shape weigh the link against it")
    s.set_defaults(run=cmd_probe)
    add_plan_parser(verb, load_spec=load_spec, emit=emit)

    add_lab_parser(sub)
    add_data_parser(sub)
    add_profile_parser(sub)
    add_quota_parser(sub)

    b = sub.add_parser("bench", help="benchmarks (sync, scaling, …); see `meridian bench -h`", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(run=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from meridian.cli.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    as_json = bool(getattr(args, "json", False))
    try:
        if args.verb == "lab":
            return run_lab(args)
        if args.verb == "data":
            return run_data(args)
        if args.verb in ("serve", "demo", "token"):
            return args.run(args)
        client = Client(args.url)
        try:
            return args.run(args, client)
        finally:
            client.close()
    except ApiError as e:
        return report(as_json, e.problem, 1)
    except CliError as e:
        return report(as_json, e.problem, e.exit_code)
    except ValueError as e:
        return report(as_json, local_problem("invalid-input", "Invalid input", str(e)), 2)
    except OSError as e:  # e.g. a token file in a folder we cannot write
        detail = f"{e.filename or ''}: {e.strerror or e}"
        return report(as_json, local_problem("local-file-error", "Local file error", detail, file=e.filename or ""), 1)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
