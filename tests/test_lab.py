"""``meridian lab`` as a user runs it (the CLI, as a process): two datacenters in their own network
namespaces, a Ray cluster across them, real TCP over the delayed link, and nothing left after ``down``.

Needs root (network namespaces, TUN devices); elsewhere it skips with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import is_gone

from meridian.lab import delay_line

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the lab creates network namespaces: run the tests as root"),
    pytest.mark.skipif(not Path("/dev/net/tun").exists(), reason="no /dev/net/tun on this machine"),
]

NAME = f"test{os.getpid()}"
CLI = [sys.executable, "-m", "meridian.cli.main", "lab"]
RTT_MS = 21.0


def _lab(*args: str, timeout: float = 240) -> dict:
    out = subprocess.run([*CLI, *args, "--name", NAME, "--json"], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def home_with_a_ray_token(tmp_path_factory):
    """A home where a plain local ``ray.init()`` once ran: it left ``~/.ray/auth_token``, and Ray's ``ray start
    --head`` then turns token authentication on by itself while ``ray start --address`` does not (the lab's nodes
    were refused until the lab chose one mode for all its processes)."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("0" * 64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        mp.delenv("RAY_AUTH_MODE", raising=False)
        yield home


@pytest.fixture(scope="module")
def lab(home_with_a_ray_token):
    up = subprocess.run([*CLI, "up", "--name", NAME, "--json", "--datacenters", "dc-a:1,dc-b:1", "--rtt-ms",
                         str(RTT_MS), "--gbps", "1"], capture_output=True, text=True, timeout=300)  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        yield json.loads(up.stdout)
    finally:
        subprocess.run([*CLI, "down", "--name", NAME], capture_output=True, timeout=120)


def _counter(netns: str, device: str) -> int:
    path = f"/sys/class/net/{device}/statistics/tx_bytes"
    return int(subprocess.run(["ip", "netns", "exec", netns, "cat", path], capture_output=True, text=True,
                              check=True).stdout)  # fmt: skip


def test_probe_sees_the_configured_delay_and_the_kernel_counts_the_bytes(lab):
    # the C line where the machine can build it (tests/test_lab_delay_line.py: both lines, and the fallback)
    assert lab["delay_line"] == ("python" if delay_line.c_compiler() is None else "native")
    r = _lab("probe", "--bulk-mb", "16")
    (link,) = r["links"]
    assert (link["src"], link["dst"]) == ("dc-a", "dc-b")
    assert link["rtt_min_ms"] >= RTT_MS  # a packet cannot beat the delay line, however idle the machine
    assert link["rtt_ms"] < RTT_MS + 30, "the delay line adds far more than the configured delay"
    assert link["link_tx_bytes"] >= link["bulk_bytes"]  # every payload byte left through dc-a's link device
    assert 0 < link["gbps"] <= 1.05  # tbf holds the rate
    # Segmentation offload: TCP hands the line segments larger than the link's 9000-byte MTU, whole (the line's
    # per-packet CPU is the lab's distortion: it shares the cores with the ranks)
    assert link["link_tx_bytes"] / link["link_tx_packets"] > 9000


def test_ray_nodes_are_labelled_and_a_gloo_all_reduce_crosses_the_link(lab):
    status = _lab("status")
    dcs = sorted(n["labels"].get("datacenter", "head") for n in status["alive_nodes"])
    assert dcs == ["dc-a", "dc-b", "head"]
    a, b = lab["datacenters"]
    before = _counter(a["netns"], a["link_device"])
    script = Path(__file__).with_name("lab_all_reduce.py")
    out = subprocess.run([sys.executable, str(script), lab["ray_address"]], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["sums"] == [3.0, 3.0]  # ranks held 1 and 2
    assert result["ifnames"] == [a["gloo_ifname"], b["gloo_ifname"]]
    assert _counter(a["netns"], a["link_device"]) - before >= result["tensor_bytes"]



def _wait_for(what: str, ok, timeout_s: float = 90.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := ok():
            return got
        time.sleep(1.0)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def test_a_killed_node_dies_whole_and_comes_back_with_the_same_ray_start(lab):
    """What ``bench recovery --cluster ray-start`` does to a node: its raylet and everything under it die at
    once, Ray notices on its own, and the node's ``ray start`` brings it back (a new node id)."""
    from meridian.lab import lab as lab_mod

    state = lab_mod.load_state(NAME)

    def dc_b() -> list[dict]:
        return [n for n in lab_mod.alive_nodes(state) if n["labels"].get("datacenter") == "dc-b"]

    (node,) = dc_b()
    family = lab_mod.descendants(lab_mod.lab_processes(f"--node_id={node['node_id']}"))
    raylet = lab_mod.kill_ray_node(node["node_id"])
    assert raylet in family and len(family) > 1  # the raylet and what it started (agents, workers)
    _wait_for("every process of the killed node gone", lambda: all(is_gone(p) for p in family), 10)
    _wait_for("Ray marks the node dead", lambda: not dc_b())
    dc = state.layout.datacenters[1]
    lab_mod.start_node(state, dc, dc.nodes[0])
    (back,) = _wait_for("the node back", dc_b)
    assert back["ip"] == node["ip"] and back["node_id"] != node["node_id"]


def test_down_removes_everything_it_made(lab):
    _lab("down")
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mrd-dc-a" not in netns and "mrd-dc-b" not in netns
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"meridian-lab-{NAME}" not in ps
    assert f"--address={lab['ray_address']}" not in ps  # the head's Ray client server too
    assert not Path(f"/run/meridian-lab/{NAME}.json").exists()
