"""``ray_cluster_processes``: stopping only the Ray cluster a test started (never ``ray stop``) stops all of it,
the Ray client server too, which names neither the temp dir nor a node and, left behind, waits a minute for the
GCS before it exits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from processes import is_gone

from meridian.lab.lab import _argv, _kill, ray_cluster_processes
from meridian.workers.distributed.ports import free_port


@pytest.mark.slow
def test_every_process_of_a_started_cluster_is_found_and_stopped():
    temp_dir = tempfile.mkdtemp(prefix="mrd-stop-")  # short: Ray's socket paths under it must fit 107 bytes
    port = free_port()
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}
    ray_bin = str(Path(sys.executable).with_name("ray"))
    found: list[int] = []
    try:
        out = subprocess.run([ray_bin, "start", "--head", "--port", str(port), "--num-cpus", "0",
                              "--include-dashboard", "false", "--temp-dir", temp_dir, "--disable-usage-stats"],
                             capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        found = ray_cluster_processes(temp_dir, port)
        argvs = [b" ".join(_argv(p)) for p in found]
        assert any(b"gcs_server" in a for a in argvs) and any(b"raylet" in a for a in argvs)
        client = [p for p, a in zip(found, argvs, strict=True) if b"ray.util.client.server" in a]
        assert client and temp_dir.encode() not in b" ".join(_argv(client[0]))  # found by the GCS's address alone
        _kill(found, grace_s=5.0)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(is_gone(p) for p in found):
            time.sleep(0.2)
        assert all(is_gone(p) for p in found), [p for p in found if not is_gone(p)]
        assert ray_cluster_processes(temp_dir, port) == []
    finally:
        _kill(ray_cluster_processes(temp_dir, port) + found, grace_s=1.0)
        shutil.rmtree(temp_dir, ignore_errors=True)
