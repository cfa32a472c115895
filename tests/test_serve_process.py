"""``meridian serve --local-datacenters`` started the way a user starts it: as a process.

It once exited at start-up (the embedded cluster was started from a worker thread, where Python refuses
signal handlers). The test waits for ``/v1/cluster`` to show both datacenters, then stops the service with
SIGINT, as Ctrl-C does, and checks it exits cleanly and takes its embedded Ray processes with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(proc.name))
    found, todo = set(), [pid]
    while todo:
        for kid in kids.get(todo.pop(), []):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def test_serve_with_local_datacenters_answers_and_stops_cleanly(tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "meridian.api.cli", "serve", "--local-datacenters", "dc-a:1,dc-b:1",
         "--port", str(port), "--data-dir", str(tmp_path / "data")],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )  # fmt: skip
    ray_processes: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        cluster = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/cluster", timeout=5)
                if r.status_code == 200 and len(r.json()["datacenters"]) == 2:
                    cluster = r.json()
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        assert proc.poll() is None, "serve exited at start-up:\n" + (tmp_path / "serve.log").read_text()[-3000:]
        assert cluster is not None, "no /v1/cluster answer within 180 s"
        assert sorted(dc["name"] for dc in cluster["datacenters"]) == ["dc-a", "dc-b"]
        ray_processes = _children(proc.pid)
        assert ray_processes, "the embedded cluster's processes should be the service's children"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        time.sleep(2)
        left = {p for p in ray_processes if Path(f"/proc/{p}").exists()
                and "Z" not in (Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[:1])}  # fmt: skip
        assert not left, f"embedded Ray processes left running: {sorted(left)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for pid in ray_processes:  # never leave a cluster behind, whatever failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
