"""``meridian bench api``: request latency of the REST API under concurrent clients.

    meridian bench api --json [--clients 50] [--requests 20] [--max-seconds 120]

Starts the API in another process on loopback (:mod:`meridian.bench.api_server`: the real app, store,
planner and auth over a fixed cluster view, no Ray, no training), then ``--clients`` concurrent clients
(one asyncio task and one keep-alive connection each) send ``--requests`` requests each, phase by phase:
``POST /v1/jobs`` (validate, plan, store a job) and ``GET /v1/jobs`` (a page of ``--list-limit`` jobs),
first paced (one request per client every ``--interval-s``, the load 50 people watching jobs make; the
latency target applies here), then flat out (back to back: the saturation throughput, where latency is
just clients ÷ throughput). Latency is measured at the client, up to the full body. Every phase is bounded
in count and time; requests left when ``--max-seconds`` is up are reported as not sent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

NAME = "api"
HELP = "p50/p99 latency of POST /v1/jobs and GET /v1/jobs with concurrent clients (service in another process)"

JOB = {"name": "bench", "model": {"preset": "nano"}, "training": {"steps": 10, "global_batch": 8, "micro_batch": 2}}
READS_TARGET_P99_MS = 50.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=50, help="concurrent clients (default 50)")
    p.add_argument("--requests", type=int, default=20, help="requests per client and phase (default 20)")
    p.add_argument("--list-limit", type=int, default=100, help="page size of GET /v1/jobs (default 100, the API's)")
    p.add_argument("--interval-s", type=float, default=0.5,
                   help="paced phases: each client sends one request this often (default 0.5, as `meridian watch`)")
    p.add_argument("--max-seconds", type=float, default=60.0, help="time bound of each phase")
    p.add_argument("--no-auth", action="store_true", help="serve without bearer tokens (default: auth on)")


def percentile(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    k = (len(sorted_ms) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (k - lo)


def summarize(latencies_ms: list[float], statuses: dict[int, int], wall_s: float, planned: int) -> dict[str, Any]:
    s = sorted(latencies_ms)
    return {
        "requests": len(s), "not_sent": planned - len(s), "status_counts": {str(k): v for k, v in sorted(statuses.items())},
        "p50_ms": round(percentile(s, 0.50), 2), "p90_ms": round(percentile(s, 0.90), 2),
        "p99_ms": round(percentile(s, 0.99), 2), "max_ms": round(s[-1], 2) if s else None,
        "mean_ms": round(statistics.fmean(s), 2) if s else None,
        "throughput_rps": round(len(s) / wall_s, 1) if wall_s > 0 else None, "wall_s": round(wall_s, 2),
    }


async def _phase(url: str, headers: dict[str, str], clients: int, per_client: int, max_s: float,
                 request: dict[str, Any], interval_s: float) -> dict[str, Any]:
    """Each client sends ``per_client`` requests on one connection: back to back (``interval_s`` 0, the
    saturation throughput) or one every ``interval_s`` (paced, like ``meridian watch`` polling). Paced
    latency counts from when a request was due, not when it was sent, so a slow server that delays the
    next request is charged for it (no coordinated omission)."""
    import httpx

    latencies: list[float] = []
    statuses: dict[int, int] = {}

    async def client(http: httpx.AsyncClient, k: int, deadline: float) -> None:
        start = time.perf_counter() + interval_s * k / clients  # spread the clients over one interval
        for i in range(per_client):
            if time.monotonic() > deadline:
                return
            due = start + i * interval_s
            if interval_s:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            t0 = due if interval_s else time.perf_counter()
            try:
                r = await http.request(**request)
                await r.aread()
                code = r.status_code
            except httpx.HTTPError:
                code = 0  # a transport error: counted under status "0", its time still measured
            latencies.append((time.perf_counter() - t0) * 1e3)
            statuses[code] = statuses.get(code, 0) + 1

    # Clients connect before the clock starts, as long-lived watchers would have: building 50 clients
    # (each loads the CA bundle, ~20 ms of blocked event loop) is not the service's latency.
    https = [httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0, limits=httpx.Limits(max_connections=1))
             for _ in range(clients)]  # fmt: skip
    try:
        await asyncio.gather(*(http.get("/healthz") for http in https))
        t0 = time.monotonic()
        await asyncio.gather(*(client(http, k, t0 + max_s) for k, http in enumerate(https)))
        result = summarize(latencies, statuses, time.monotonic() - t0, clients * per_client)
    finally:
        await asyncio.gather(*(http.aclose() for http in https))
    result["interval_s"] = interval_s
    return result


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used, from /proc (None where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _start_server(data_dir: str, token_file: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "meridian.bench.api_server", "--data-dir", data_dir]
    if token_file:
        cmd += ["--token-file", token_file]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line.startswith("READY "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            raise RuntimeError(f"the API server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
    proc.kill()
    raise RuntimeError(f"the API server did not start within {timeout_s:.0f} s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("clients", "requests", "list_limit"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.interval_s <= 0 or args.max_seconds <= 0:
        raise ValueError("--interval-s and --max-seconds must be > 0")
    if not 1 <= args.list_limit <= 1000:
        raise ValueError("--list-limit must be between 1 and 1000 (the API's bound)")
    from meridian.api.auth import create_token

    with tempfile.TemporaryDirectory(prefix="meridian-bench-api-") as tmp:
        headers: dict[str, str] = {}
        token_file = ""
        if not args.no_auth:
            token_file = os.path.join(tmp, "tokens.json")
            headers["Authorization"] = f"Bearer {create_token(token_file, 'bench')}"
        proc, url = _start_server(tmp, token_file)
        load_before = os.getloadavg()
        try:
            post = {"method": "POST", "url": "/v1/jobs", "json": JOB}
            get = {"method": "GET", "url": "/v1/jobs", "params": {"limit": args.list_limit}}
            phases = {}
            for name, request, interval in (("post_jobs", post, args.interval_s), ("get_jobs", get, args.interval_s),
                                            ("get_jobs_saturated", get, 0.0), ("post_jobs_saturated", post, 0.0)):
                cpu0 = _cpu_s(proc.pid)
                phases[name] = asyncio.run(_phase(url, headers, args.clients, args.requests, args.max_seconds,
                                                  request, interval))
                cpu1 = _cpu_s(proc.pid)
                # The service's own CPU per request: what a request costs, whatever else loads the machine.
                done = phases[name]["requests"]
                phases[name]["server_cpu_ms_per_request"] = (
                    round((cpu1 - cpu0) * 1e3 / done, 2) if cpu0 is not None and cpu1 is not None and done else None)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {
        "what": "client-measured latency, service in another process on loopback (real app, SQLite store, "
                "planner, auth; fixed 2-DC cluster view, no Ray); POST phase first, then GET",
        "clients": args.clients, "requests_per_client": args.requests, "auth": not args.no_auth,
        "list_limit": args.list_limit, "cpu_count": os.cpu_count(),
        # Other processes compete for the same cores: the 1-minute load average says how much.
        "load_avg_1m_before": round(load_before[0], 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
        **phases,
        "reads_target_p99_ms": READS_TARGET_P99_MS,
        "reads_meet_target": phases["get_jobs"]["p99_ms"] < READS_TARGET_P99_MS,
    }


def render(r: dict[str, Any]) -> str:
    lines = [f"{r['clients']} clients × {r['requests_per_client']} requests, auth {'on' if r['auth'] else 'off'}, "
             f"{r['cpu_count']} CPUs, load average {r['load_avg_1m_before']} → {r['load_avg_1m_after']}"]
    get = f"GET /v1/jobs?limit={r['list_limit']}"
    for label, key in (("POST /v1/jobs paced", "post_jobs"), (f"{get} paced", "get_jobs"),
                       (f"{get} flat out", "get_jobs_saturated"), ("POST /v1/jobs flat out", "post_jobs_saturated")):
        p = r[key]
        lines.append(f"{label:<34} p50 {p['p50_ms']:>7.1f} ms  p99 {p['p99_ms']:>7.1f} ms  max {p['max_ms']:>7.1f} ms  "
                     f"{p['throughput_rps']:>6.1f} req/s  server CPU {p['server_cpu_ms_per_request']} ms/req  "
                     f"statuses {p['status_counts']}")
    lines.append(f"reads p99 target {r['reads_target_p99_ms']:.0f} ms: {'met' if r['reads_meet_target'] else 'NOT met'}")
    return "\n".join(lines)
