"""``meridian bench scale``: the control plane with N simulated ranks, no model.

    meridian bench scale --ranks 3072 --datacenters 2 --json

Starts a local Ray cluster, the service in another process (:mod:`meridian.bench.scale_server`: the real app,
store, planner and supervisor, which launches and polls the job's runner actor as it does any job's) and
``--processes`` processes of simulated ranks (:mod:`meridian.bench.scale_ranks`, ``8`` per simulated node), which
speak the workers' rendezvous, heartbeat and step-record protocol to the runner. It submits one job of
``--ranks`` workers over the API and measures:

- ``first_epoch_s``: from the ranks' first join to the last rank's assignment in the first epoch;
- ``runner_cpu_cores``: CPU-seconds of the runner actor's process per second over ``--steady-s`` of steps
  (one step per ``--step-s``), from ``/proc/<pid>/stat``;
- ``store_rows_per_s``: rows the service wrote to the job's records and events over that window (SQLite);
- ``reform_s``: from one node's ranks stopping (its peers' epoch breaks, and Ray's view loses the node at once:
  Ray's own detection delay is not in the figure) to the last survivor's assignment in the new epoch;
- ``api_get``: latency of ``GET /v1/jobs/{id}`` and ``GET /v1/jobs`` at ``--api-rps`` while all of it runs;
- ``phases``: for the first epoch and the re-formation, when the coordinator formed the epoch (``formed_s``, from its
  ``epoch_formed`` event: the rest of the phase is the ranks collecting their assignments) and the CPU-seconds the
  runner's process and the simulated ranks' processes spent in it (they share this machine's cores).

Every wait is bounded by ``--timeout-s``; a phase that does not finish in time is reported as ``null`` with the
reason in ``errors``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import queue
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from meridian.bench.api import percentile
from meridian.bench.scale_server import RANKS_PER_NODE, node_ids

NAME = "scale"
HELP = "the control plane (rendezvous, heartbeats, step records, API) with N simulated ranks, no model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=256, help=f"simulated ranks, {RANKS_PER_NODE} per node (default 256)")
    p.add_argument("--datacenters", type=int, default=2, help="datacenters the nodes are split over (default 2)")
    p.add_argument("--processes", type=int, default=4, help="processes hosting the simulated ranks (default 4)")
    p.add_argument("--step-s", type=float, default=1.0, help="seconds per simulated step (default 1)")
    p.add_argument("--steady-s", type=float, default=10.0, help="window of steps the CPU and store rates are read over")
    p.add_argument("--beats-per", choices=("rank", "node"), default="rank",
                   help="one heartbeat call per rank (what workers do) or per node, every --beats-every-s")
    p.add_argument("--beats-every-s", type=float, default=0.0,
                   help="heartbeat batch period (default 0: the workers', sized to the epoch: 0.25 s, 2 s at 3,072 ranks)")
    p.add_argument("--api-rps", type=float, default=10.0, help="API GETs per second while it runs (default 10)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="bound of each phase (default 120)")
    p.add_argument("--no-loss", action="store_true", help="skip losing a node")
    p.add_argument("--profile-runner", default="",
                   help="write py-spy's raw samples of the runner actor's process (from the first join to the end) here")


class Api:
    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, Any, float]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            t = time.perf_counter()
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            return r.status, json.loads(data) if data else None, (time.perf_counter() - t) * 1000
        finally:
            conn.close()


class Prober(threading.Thread):
    """GETs the job and the job list at a steady rate; latencies in ms, failures counted."""

    def __init__(self, api: Api, job_id: str, rps: float) -> None:
        super().__init__(daemon=True)
        self.api, self.job_id, self.period = api, job_id, 1.0 / rps
        self.ms: list[float] = []
        self.failed: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        paths = (f"/v1/jobs/{self.job_id}", "/v1/jobs?limit=20")
        i = 0
        while not self.stop.wait(self.period):
            try:
                status, _, ms = self.api.call("GET", paths[i % 2], timeout=10)
                if status == 200:
                    self.ms.append(ms)
                else:
                    self.failed[str(status)] = self.failed.get(str(status), 0) + 1
            except Exception as e:  # noqa: BLE001 - counted: a timeout is a result here
                self.failed[type(e).__name__] = self.failed.get(type(e).__name__, 0) + 1
            i += 1


class RankProcs:
    def __init__(self, cmds: list[list[str]]) -> None:
        self.procs = [subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for c in cmds]
        self.lines: queue.Queue[tuple[int, dict]] = queue.Queue()
        for i, p in enumerate(self.procs):
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()

    def _read(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            with contextlib.suppress(json.JSONDecodeError):
                self.lines.put((i, json.loads(line)))

    def send(self, line: str) -> None:
        for p in self.procs:
            p.stdin.write(line + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.stdin.write("quit\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _wait_until(what: str, cond: Any, timeout_s: float, every_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rows(db: str, job_id: str) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        n = 0
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'"):
            cols = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
            if "job_id" in cols and table in ("records", "events", "job_records", "job_events", "metrics"):
                n += con.execute(f"SELECT COUNT(*) FROM {table} WHERE job_id=?", (job_id,)).fetchone()[0]
        return n
    finally:
        con.close()


def _formed_at(db: str, job_id: str, epoch: int, timeout_s: float) -> float | None:
    """The wall time of epoch ``epoch``'s ``epoch_formed`` event, once the service has stored it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(db):
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
            try:
                for (data,) in con.execute("SELECT data FROM events WHERE job_id=? AND kind='epoch_formed'", (job_id,)):
                    d = json.loads(data)
                    if d.get("epoch") == epoch and "time" in d:
                        return float(d["time"])
            except sqlite3.Error:
                pass
            finally:
                con.close()
        time.sleep(0.5)
    return None


class PhaseCpu:
    """CPU-seconds of the runner's process and of the rank processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, runner_pid: int, rank_pids: list[int]) -> None:
        self.pids = [runner_pid, *rank_pids]
        self.at: list[float] = []

    def _now(self) -> list[float]:
        out = []
        for pid in self.pids:
            try:
                out.append(_cpu_s(pid))
            except OSError:
                out.append(0.0)
        return out

    def start(self) -> None:
        self.at = self._now()

    def stop(self) -> dict[str, float]:
        d = [b - a for a, b in zip(self.at, self._now(), strict=True)]
        return {"runner_cpu_s": round(d[0], 2), "ranks_cpu_s": round(sum(d[1:]), 2)}


def _await_epoch(procs: RankProcs, min_epoch: int, ranks: int, timeout_s: float, errors: list[str]) -> float:
    """The wall time the last of ``ranks`` ranks got an assignment in an epoch ≥ ``min_epoch``."""
    got: dict[int, tuple[int, int, float]] = {}  # process → (epoch, ranks, last_at)
    worlds: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while sum(r for e, r, _ in got.values() if e >= min_epoch) < ranks:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"epoch {min_epoch}: {sum(r for e, r, _ in got.values() if e >= min_epoch)} of "
                               f"{ranks} ranks assigned within {timeout_s:.0f} s")
        try:
            i, msg = procs.lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if "error" in msg:
            errors.append(msg["error"])
        elif "epoch" in msg and msg["epoch"] >= min_epoch:
            got[i] = (msg["epoch"], msg["ranks"], msg["last_at"])
            worlds.add(msg["world_size"])
    if worlds != {ranks}:
        errors.append(f"epoch {min_epoch}: the processes' ranks were told world sizes {sorted(worlds)}, not {ranks}")
    return max(t for _, _, t in got.values())


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.ranks % (RANKS_PER_NODE * args.datacenters):
        raise ValueError(f"--ranks must be a multiple of {RANKS_PER_NODE} x --datacenters "
                         f"({RANKS_PER_NODE * args.datacenters}), got {args.ranks}")
    import ray

    from meridian.service.cluster.connect import NAMESPACE
    from meridian.service.runner.actor import runner_name

    nodes_per_dc = args.ranks // RANKS_PER_NODE // args.datacenters
    nodes = node_ids(args.datacenters, nodes_per_dc)
    out: dict[str, Any] = {"ranks": args.ranks, "nodes": len(nodes), "datacenters": args.datacenters,
                           "processes": args.processes, "step_s": args.step_s, "beats_per": args.beats_per,
                           "beats_every_s": args.beats_every_s, "first_epoch_s": None, "reform_s": None,
                           "runner_cpu_cores": None, "store_rows_per_s": None, "errors": []}
    errors: list[str] = out["errors"]
    tmp = tempfile.mkdtemp(prefix="meridian-bench-scale-")
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
             _temp_dir=os.path.join(tmp, "ray"))
    server = procs = prober = spying = None
    try:
        address = ray.get_runtime_context().gcs_address
        server = subprocess.Popen([sys.executable, "-m", "meridian.bench.scale_server", "--ray-address", address,
                                   "--data-dir", tmp, "--dcs", str(args.datacenters), "--nodes-per-dc",
                                   str(nodes_per_dc)], stdout=subprocess.PIPE, text=True)
        ready = server.stdout.readline()  # type: ignore[union-attr]
        if not ready.startswith("READY "):
            raise RuntimeError(f"the service did not start (said {ready!r})")
        api = Api(ready.split()[1])
        status, job, _ = api.call("POST", "/v1/jobs", {
            "name": "scale", "model": {"preset": "nano"},
            "training": {"steps": 1_000_000, "global_batch": args.ranks, "micro_batch": 1},
            "topology": {"workers_per_datacenter": args.ranks // args.datacenters}})
        if status != 201:
            raise RuntimeError(f"POST /v1/jobs answered {status}: {job}")
        job_id = job["id"]
        name = runner_name(job_id)

        def runner() -> Any:
            try:
                return ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return None

        actor = _wait_until("the runner actor", runner, args.timeout_s)
        pid = ray.get(actor.sim_pid.remote(), timeout=30)
        if args.profile_runner:
            spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
            if spy is None:
                raise RuntimeError("--profile-runner needs py-spy (pip install py-spy)")
            spying = subprocess.Popen([spy, "record", "-p", str(pid), "-f", "raw", "-r", "50", "--nonblocking",
                                       "-o", args.profile_runner], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        prober = Prober(api, job_id, args.api_rps)
        prober.start()
        per_proc = [nodes[i::args.processes] for i in range(args.processes)]
        procs = RankProcs([[sys.executable, "-m", "meridian.bench.scale_ranks", "--ray-address", address,
                            "--namespace", NAMESPACE, "--runner", name, "--nodes", ",".join(f"{n}@{d}" for n, d in mine),
                            "--ranks-per-node", str(RANKS_PER_NODE), "--step-s", str(args.step_s),
                            "--beats-per", args.beats_per, "--beats-every-s", str(args.beats_every_s)]
                           for mine in per_proc if mine])
        seen = 0
        deadline = time.monotonic() + args.timeout_s
        while seen < len(procs.procs):
            _, msg = procs.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            seen += "ready" in msg
        phase = PhaseCpu(pid, [p.pid for p in procs.procs])
        phases: dict[str, Any] = {}
        out["phases"] = phases
        phase.start()
        t0 = time.time()
        procs.send("go")
        out["first_epoch_s"] = round(_await_epoch(procs, 1, args.ranks, args.timeout_s, errors) - t0, 3)
        phases["first_epoch"] = phase.stop()
        db = os.path.join(tmp, "meridian.db")

        time.sleep(min(args.steady_s, 3 * args.step_s))  # the first steps' records and beats arrive
        rows0, cpu0, w0 = (_rows(db, job_id) if os.path.exists(db) else 0), _cpu_s(pid), time.monotonic()
        time.sleep(args.steady_s)
        rows1, cpu1, w1 = (_rows(db, job_id) if os.path.exists(db) else 0), _cpu_s(pid), time.monotonic()
        out["runner_cpu_cores"] = round((cpu1 - cpu0) / (w1 - w0), 3)
        out["store_rows_per_s"] = round((rows1 - rows0) / (w1 - w0), 2)
        out["store_db_found"] = os.path.exists(db)

        if not args.no_loss:
            lost = nodes[-1][0]  # the last node of the last datacenter
            phase.start()
            t1 = time.time()
            procs.send(f"lose {lost}")
            actor.sim_lose_node.remote(lost)
            out["lost_node"] = lost
            out["reform_s"] = round(_await_epoch(procs, 2, args.ranks - RANKS_PER_NODE, args.timeout_s, errors) - t1, 3)
            phases["reform"] = phase.stop()
            formed = _formed_at(db, job_id, 2, 15.0)
            phases["reform"]["formed_s"] = round(formed - t1, 3) if formed is not None else None
        formed = _formed_at(db, job_id, 1, 15.0)
        phases["first_epoch"]["formed_s"] = round(formed - t0, 3) if formed is not None else None
        status, job, _ = api.call("GET", f"/v1/jobs/{job_id}")
        out["job_state"] = job.get("state") if isinstance(job, dict) else None
    except (TimeoutError, RuntimeError, queue.Empty) as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        if prober is not None:
            prober.stop.set()
            prober.join(15)
            s = sorted(prober.ms)
            out["api_get"] = {"requests": len(s), "failed": prober.failed, "p50_ms": round(percentile(s, 0.5), 2),
                              "p99_ms": round(percentile(s, 0.99), 2), "max_ms": round(s[-1], 2) if s else None}
        if spying is not None:
            spying.send_signal(signal.SIGINT)  # py-spy writes what it sampled
            try:
                spying.wait(30)
            except subprocess.TimeoutExpired:
                spying.kill()
        if procs is not None:
            procs.close()
        if server is not None:
            server.terminate()
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(5)
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)  # the service's store and Ray's session files: read above
        out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return out
