"""``meridian bench recovery --cluster ray-start``: torchft's side crosses the same lab link as Meridian's, each
replica group in its datacenter's namespace on a lab node's address (on loopback it would not pay the link)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the lab creates network namespaces: run the tests as root"),
    pytest.mark.skipif(not Path("/dev/net/tun").exists(), reason="no /dev/net/tun on this machine"),
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                       reason="torchft 0.2.0 ships one wheel, for CPython 3.11"),  # fmt: skip
]


def test_torchft_groups_train_heal_and_recover_across_the_lab_link():
    cmd = [sys.executable, "-m", "meridian.api.cli", "bench", "recovery", "--json", "--sides", "torchft",
           "--rounds", "1", "--cluster", "ray-start", "--lab-rtt-ms", "5",
           # short windows: this test checks the path (heal, kill, go on, take back), not the throughput
           "--kill-after-s", "5", "--back-after-s", "10"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout)["torchft"]["runs"][0]
    assert "lab namespace across the same 5 ms" in run["runs_on"]
    # the groups in the second datacenter healed from the first (its checkpoint server reachable across the
    # link), trained, lost one group to the kill, went on and took it back
    assert run["steps_lost"] <= 1 and run["kill_to_next_step_s"] > 0 and run["scale_up_s"] is not None, run
    # the lighthouse's log says how the shrunk quorum formed, before its first step
    shrunk = run["lighthouse"]
    assert shrunk["participants"] < 4 and 0 < shrunk["formed_after_kill_s"] <= run["kill_to_next_step_s"], run
    assert not Path("/run/meridian-lab/bench-recovery-torchft.json").exists()  # the lab came down
