"""Restart safety and worker logs against a real Ray cluster: the service runs as its own process
(`meridian serve`), is killed with SIGKILL mid-job and started again on the same database."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from fakes import spec
from processes import process_group

from meridian.workers.distributed.ports import free_port

pytestmark = pytest.mark.slow


class ServiceProcess:
    """``meridian serve --address`` as a process in a group of its own (:func:`processes.process_group`), healthy
    when constructed; the group ends when ``kill`` or ``stop`` is called, when start-up fails, and, through the
    group's guard, when the test process dies first."""

    def __init__(self, address: str, data_dir: str, log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        self._group = process_group(
            [sys.executable, "-m", "meridian.cli.main", "serve", "--address", address, "--port", str(self.port),
             "--data-dir", data_dir, "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )  # fmt: skip
        self.proc = self._group.__enter__()
        try:
            self._wait_healthy(log_path)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, log_path: str) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=5).json()["status"] == "ok":
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"meridian serve exited with {self.proc.returncode}; see {log_path}")
            time.sleep(0.5)
        raise RuntimeError(f"meridian serve did not become healthy in 90 s; see {log_path}")

    def kill(self) -> None:
        """SIGKILL, as a crash ends it: no clean shutdown."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; the group and what was below the service end either way."""
        if self.log.closed:
            return
        try:
            self._group.__exit__(None, None, None)
        finally:
            self.log.close()


@pytest.fixture(scope="module")
def cluster(two_nodes):  # shared with the next module that asks for it
    return two_nodes


def wait_job(url, job_id, until, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()
        if until(job):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not get there in {timeout_s} s: {job['state']} {job['message']}")


def test_killed_service_reattaches_to_the_live_run_and_serves_its_logs(cluster, tmp_path):
    data_dir, log = str(tmp_path / "data"), str(tmp_path / "serve.log")
    steps = 150
    first = ServiceProcess(cluster.address, data_dir, log)
    try:
        r = httpx.post(f"{first.url}/v1/jobs", timeout=30, json=spec(
            training={"steps": steps, "global_batch": 4, "micro_batch": 2}, topology={"workers_per_datacenter": 1}))
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        before = wait_job(first.url, job_id, lambda j: j["progress"]["step"] >= 3 or j["state"] in ("failed", "succeeded"), 300)
        assert before["state"] == "running", before["message"]
    finally:
        first.kill()  # mid-job, no clean shutdown

    second = ServiceProcess(cluster.address, data_dir, log)
    try:
        job = wait_job(second.url, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), 600)
        assert job["state"] == "succeeded", job["message"]
        points = httpx.get(f"{second.url}/v1/jobs/{job_id}/metrics", timeout=30).json()["points"]
        assert [p["step"] for p in points] == list(range(1, steps + 1))  # every step once: none lost, none twice
        events = httpx.get(f"{second.url}/v1/jobs/{job_id}/events", timeout=30).json()["events"]
        kinds = [e["kind"] for e in events]
        assert kinds.count("reattached") == 1 and kinds.count("worker_started") == 2  # one run, not a second
        assert httpx.get(f"{second.url}/v1/jobs", timeout=30).json()["count"] == 1

        # Worker logs: what the endpoint returns is what Ray wrote to each rank's files on its node.
        logs = httpx.get(f"{second.url}/v1/jobs/{job_id}/logs", params={"tail_kb": 1024}, timeout=60).json()["lines"]
        logs_dir = os.path.join(cluster.head_node.get_session_dir_path(), "logs")
        for p in job["placement"]:
            for stream in ("out", "err"):
                (path,) = glob.glob(os.path.join(logs_dir, f"worker-*-{p['pid']}.{stream}"))
                with open(path, encoding="utf-8", errors="replace") as f:
                    on_disk = f.read().splitlines()
                got = [x["line"] for x in logs if x["rank"] == p["rank"] and x["stream"] == stream]
                assert got == on_disk[-len(got):] if got else on_disk == [], (p["rank"], stream)
        assert {x["rank"] for x in logs} == {0, 1}
        with httpx.stream("GET", f"{second.url}/v1/jobs/{job_id}/logs", params={"follow": "true", "tail_kb": 1024},
                          timeout=60) as s:
            followed = [json.loads(line) for line in s.iter_lines() if line]
        assert followed == logs  # a finished job's follow: the same lines, then the stream ends
    finally:
        second.stop()
