"""``meridian bench recovery --sides torchft``: torchft's side on this machine's loopback and across the lab's
link, and its two outcomes after a group dies, told apart by its lighthouse's own log.

With ``--torchft-kill-phase between-steps`` the victim kills itself right after a committed step, before it asks
for the next quorum. No survivor is then blocked in a collective with it: all three ask, three of the four groups
the lighthouse still counts alive is a majority, and the quorum forms after the join timeout, not the heartbeat
timeout. (Killed at whatever point of a step, the usual outcome leaves one survivor blocked and the others waiting
for the dead group's heartbeat to expire: docs/benchmarks/recovery.md.)

With ``--cluster ray-start`` torchft's side crosses the same lab link as Meridian's, each replica group in its
datacenter's namespace on a lab node's address (on loopback it would not pay the link).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                       reason="torchft 0.2.0 ships one wheel, for CPython 3.11"),  # fmt: skip
]


def _torchft_side(*args: str) -> dict[str, Any]:
    """One round of the torchft side, with short windows (these tests check the path a run takes, not its
    throughput): the report."""
    cmd = [sys.executable, "-m", "meridian.cli.main", "bench", "recovery", "--json", "--sides", "torchft",
           "--rounds", "1", "--kill-after-s", "5", *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_a_group_that_dies_between_steps_is_dropped_without_waiting_for_its_heartbeat():
    report = _torchft_side("--torchft-kill-phase", "between-steps", "--back-after-s", "5")
    assert report["setup"]["torchft_kill_phase"] == "between-steps"
    run = report["torchft"]["runs"][0]
    assert "by itself right after a committed step" in run["killed"]
    shrunk = run["lighthouse"]
    assert shrunk["participants"] == 3 and shrunk["heartbeating"] == 4, run
    assert shrunk["waited_for_heartbeat_timeout"] is False and "join timeout" in shrunk["held_by"], run
    # the dead group had trained its last step with the others: nothing was lost, and it healed when it came back
    assert run["steps_lost"] == 0 and run["scale_up_s"] is not None, run
    assert 0 < shrunk["formed_after_kill_s"] <= run["kill_to_next_step_s"], run


@pytest.mark.skipif(os.geteuid() != 0, reason="the lab creates network namespaces: run the tests as root")
@pytest.mark.skipif(not Path("/dev/net/tun").exists(), reason="no /dev/net/tun on this machine")
def test_torchft_groups_train_heal_and_recover_across_the_lab_link():
    report = _torchft_side("--cluster", "ray-start", "--lab-rtt-ms", "5", "--back-after-s", "10")
    run = report["torchft"]["runs"][0]
    assert "lab namespace across the same 5 ms" in run["runs_on"]
    # the groups in the second datacenter healed from the first (its checkpoint server reachable across the
    # link), trained, lost one group to the kill, went on and took it back
    assert run["steps_lost"] <= 1 and run["kill_to_next_step_s"] > 0 and run["scale_up_s"] is not None, run
    # the lighthouse's log says how the shrunk quorum formed, before its first step
    shrunk = run["lighthouse"]
    assert shrunk["participants"] < 4 and 0 < shrunk["formed_after_kill_s"] <= run["kill_to_next_step_s"], run
    assert not Path("/run/meridian-lab/bench-recovery-torchft.json").exists()  # the lab came down
