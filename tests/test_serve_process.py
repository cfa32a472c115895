"""``meridian serve --local-datacenters`` started the way a user starts it: as a process.

It once exited at start-up (the embedded cluster was started from a worker thread, where Python refuses
signal handlers). The test waits for ``/v1/cluster`` to show both datacenters, then stops the service with
SIGINT, as Ctrl-C does, and checks it exits cleanly and takes its embedded Ray processes with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fakes import spec
from processes import descendants, is_gone, process_group

from meridian.workers.distributed.ports import free_port
from meridian.workers.state.snapshot_paths import snapshot_dirs

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def serving(tmp_path: Path, *extra: str, datacenters: str = "dc-a:1,dc-b:1"):
    """``meridian serve --local-datacenters …`` as a process; yields (process, base URL, the /v1/cluster
    answer) once both datacenters show. Its process group and everything below it end with the block, whatever
    the test did (:func:`processes.process_group`)."""
    port = free_port()
    argv = [sys.executable, "-m", "meridian.cli.main", "serve", "--local-datacenters", datacenters,
            "--port", str(port), "--data-dir", str(tmp_path / "data"), *extra]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "w") as log, process_group(
        argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    ) as proc:
        deadline = time.monotonic() + 180
        cluster = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(f"{base}/v1/cluster", timeout=5)
                if r.status_code == 200 and len(r.json()["datacenters"]) == 2:
                    cluster = r.json()
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        assert proc.poll() is None, "serve exited at start-up:\n" + (tmp_path / "serve.log").read_text()[-3000:]
        assert cluster is not None, "no /v1/cluster answer within 180 s"
        proc.ray_processes = descendants(proc.pid)
        try:
            yield proc, base, cluster
        finally:
            for pid in proc.ray_processes:  # never leave a cluster behind, whatever failed
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_serve_with_local_datacenters_answers_and_stops_cleanly(tmp_path):
    with serving(tmp_path) as (proc, base, cluster):
        assert sorted(dc["name"] for dc in cluster["datacenters"]) == ["dc-a", "dc-b"]
        # The compute probe runs on every worker slot (one per datacenter here) and feeds the plans of that shape
        job = spec(training={"micro_batch": 1})
        before = httpx.post(f"{base}/v1/plans", json=job, timeout=30).json()
        assert "compute probe" not in before["explanation"]
        measured = httpx.post(f"{base}/v1/diagnostics/compute", json=job, timeout=300)
        assert measured.status_code == 200, measured.text
        assert measured.json()["slots"] == 2 and measured.json()["flops"] > 0
        after = httpx.post(f"{base}/v1/plans", json=job, timeout=30).json()
        assert "compute probe of this model shape" in after["explanation"]
        assert after["estimate"]["compute_s"] != before["estimate"]["compute_s"]
        # Stopped while a job trains: its workers' snapshots in RAM go with the cluster that ran them.
        running = httpx.post(f"{base}/v1/jobs", json=spec(training={"steps": 100_000}), timeout=30).json()
        deadline = time.monotonic() + 120
        while len(snapshot_dirs(running["id"])) < 2:
            assert time.monotonic() < deadline, "the job's workers kept no snapshots within 120 s"
            time.sleep(0.5)
        ray_processes = descendants(proc.pid)
        assert ray_processes, "the embedded cluster's processes should be the service's children"
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as a person stops it
        assert proc.wait(timeout=90) == 0
        # a clean stop says nothing alarming (uvicorn's lifespan task, cancelled by a second Ctrl-C, once logged an
        # ERROR traceback; the service now runs uvicorn without one)
        log = (tmp_path / "serve.log").read_text()
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
        time.sleep(2)
        left = {p for p in ray_processes if not is_gone(p)}
        assert not left, f"embedded Ray processes left running: {sorted(left)}"
        assert snapshot_dirs(running["id"]) == [], "the stopped job's snapshots were left in RAM"


def test_serve_on_postgresql_runs_a_job_to_the_end(tmp_path, postgres_server):
    """The store on a real PostgreSQL, the whole way a user runs it: ``meridian serve --database-url``,
    a job over HTTP that trains across two datacenters, its events as a live SSE stream, its metrics, its
    final weights in ``--storage``; and a second service on the same database is refused while the first
    holds it."""
    url = postgres_server.new_database()
    storage = tmp_path / "shared-storage"  # --storage: checkpoints and final weights go here, not the data dir
    with serving(tmp_path, "--database-url", url, "--storage", str(storage)) as (_, base, _):
        job = httpx.post(f"{base}/v1/jobs", json=spec(name="pg", training={"steps": 6}), timeout=30).json()
        events, last_id, name = [], 0, "message"
        with httpx.stream("GET", f"{base}/v1/jobs/{job['id']}/events", headers={"Accept": "text/event-stream"},
                          timeout=httpx.Timeout(30, read=240)) as stream:  # ends after the job's last event
            for line in stream.iter_lines():
                if line.startswith("id:"):
                    last_id = int(line.split(":", 1)[1])
                elif line.startswith("event:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and name != "end":
                    events.append((last_id, json.loads(line.split(":", 1)[1])))
        final = httpx.get(f"{base}/v1/jobs/{job['id']}", timeout=30).json()
        assert final["state"] == "succeeded", final
        states = [e["data"]["state"] for _, e in events if e.get("kind") == "state"]
        assert states[0] == "queued" and states[-1] == "succeeded" and "running" in states
        ids = [i for i, _ in events]
        assert ids == sorted(set(ids)), "SSE event ids must be unique and increasing"
        metrics = httpx.get(f"{base}/v1/jobs/{job['id']}/metrics", timeout=30).json()
        assert [m["step"] for m in metrics["points"]][-1] == 6
        artifacts = httpx.get(f"{base}/v1/jobs/{job['id']}/artifacts", timeout=30).json()
        assert artifacts["storage"] == str(storage / job["id"]) and artifacts["artifacts"][-1]["final"]
        assert artifacts["latest"].startswith(str(storage))

        with process_group(
            [sys.executable, "-m", "meridian.cli.main", "serve", "--database-url", url, "--port", "1",
             "--data-dir", str(tmp_path / "other"), "--local-datacenters", "dc-a:1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        ) as second:  # fmt: skip
            _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and "owns this database" in err, err[-2000:]
