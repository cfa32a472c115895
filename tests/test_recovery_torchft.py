"""``meridian bench recovery --sides torchft`` on this machine's loopback: torchft's two outcomes after a group dies,
told apart by its lighthouse's own log.

With ``--torchft-kill-phase between-steps`` the victim kills itself right after a committed step, before it asks
for the next quorum. No survivor is then blocked in a collective with it: all three ask, three of the four groups
the lighthouse still counts alive is a majority, and the quorum forms after the join timeout, not the heartbeat
timeout. (Killed at whatever point of a step, the usual outcome leaves one survivor blocked and the others waiting
for the dead group's heartbeat to expire: ``bench recovery``'s rounds in the README.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                       reason="torchft 0.2.0 ships one wheel, for CPython 3.11"),  # fmt: skip
]


def test_a_group_that_dies_between_steps_is_dropped_without_waiting_for_its_heartbeat():
    cmd = [sys.executable, "-m", "meridian.api.cli", "bench", "recovery", "--json", "--sides", "torchft",
           "--rounds", "1", "--torchft-kill-phase", "between-steps",
           # short windows: this test checks which way the quorum re-formed, not the throughput
           "--kill-after-s", "5", "--back-after-s", "5"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["setup"]["torchft_kill_phase"] == "between-steps"
    run = report["torchft"]["runs"][0]
    assert "by itself right after a committed step" in run["killed"]
    shrunk = run["lighthouse"]
    assert shrunk["participants"] == 3 and shrunk["heartbeating"] == 4, run
    assert shrunk["waited_for_heartbeat_timeout"] is False and "join timeout" in shrunk["held_by"], run
    # the dead group had trained its last step with the others: nothing was lost, and it healed when it came back
    assert run["steps_lost"] == 0 and run["scale_up_s"] is not None, run
    assert 0 < shrunk["formed_after_kill_s"] <= run["kill_to_next_step_s"], run
