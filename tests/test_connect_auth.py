"""Joining a ``ray start`` cluster that uses token authentication: Ray's ``ray start --head`` turns it on by itself
where ``~/.ray/auth_token`` exists, and a process given the cluster's address does not follow: Ray reports only a
failed connection (after 20 s). Meridian's error says what to set, and it joins once that is set."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ray._private.services import get_node_ip_address

from meridian.lab.lab import _kill, ray_cluster_processes
from meridian.workers.distributed.ports import free_port

pytestmark = pytest.mark.slow

JOIN = """
import json, sys
from meridian.service.cluster.connect import connect
try:
    connect(sys.argv[1])
except ConnectionError as e:
    print(json.dumps({"error": str(e)}))
else:
    import ray
    print(json.dumps({"nodes": len(ray.nodes())}))
"""


@pytest.fixture
def token_cluster(tmp_path):
    """A ``ray start --head`` in a home holding a token, so Ray turns token authentication on by itself."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("1" * 64)
    temp_dir = tempfile.mkdtemp(prefix="mrd-auth-")  # short: Ray's socket paths under it must fit 107 bytes
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {
        "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    ray_bin = str(Path(sys.executable).with_name("ray"))
    ip = get_node_ip_address()  # what Ray turns 127.0.0.1 into when a driver connects
    out = subprocess.run([ray_bin, "start", "--head", "--node-ip-address", ip, "--port", str(port),
                          "--num-cpus", "0", "--include-dashboard", "false", "--temp-dir", temp_dir,
                          "--disable-usage-stats"], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    try:
        assert out.returncode == 0, out.stderr[-2000:]
        yield f"{ip}:{port}", env
    finally:  # only what this test started: never `ray stop`
        _kill(ray_cluster_processes(temp_dir, port))
        shutil.rmtree(temp_dir, ignore_errors=True)


def _join(address: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", JOIN, address], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_token_cluster_refuses_with_what_to_set_and_joins_once_it_is_set(token_cluster):
    address, env = token_cluster
    refused = _join(address, env)
    assert "RAY_AUTH_MODE=token" in refused and '"error"' in refused
    assert '"nodes": 1' in _join(address, env | {"RAY_AUTH_MODE": "token"})  # the token from the same home
