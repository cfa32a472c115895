"""``processes.process_group``, through which tests start ``meridian serve`` as a process: the group and what was
below its leader end with the block whatever happened in it, and end too when the test process dies inside it
(a test run killed, or pytest-timeout's ``os._exit``), which is how services were once left holding ports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import is_gone, process_group

# A leader with a child in its group and a grandchild that left for a session of its own (as Ray's workers do);
# it prints the three pids and waits.
TREE = ["bash", "-c", "sleep 600 & a=$!; setsid sleep 600 & b=$!; echo $$ $a $b; wait"]


def _gone_within(pids: list[int], bound_s: float) -> list[int]:
    deadline = time.monotonic() + bound_s
    while (left := [p for p in pids if not is_gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _pids(proc: subprocess.Popen) -> list[int]:
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3, pids
    time.sleep(0.3)  # `setsid` has exec'd its sleep
    return pids


def test_the_group_and_a_process_that_left_it_end_when_the_block_raises():
    with pytest.raises(RuntimeError, match="the test failed"), process_group(
        TREE, stdout=subprocess.PIPE, text=True
    ) as proc:
        pids = _pids(proc)
        assert not any(is_gone(p) for p in pids)
        raise RuntimeError("the test failed")
    assert _gone_within(pids, 5) == []
    assert proc.returncode is not None


def test_a_leader_that_ends_by_itself_within_the_grace_is_not_signalled():
    with process_group(["bash", "-c", "trap 'exit 7' TERM; sleep 0.5; exit 3"], grace_s=30) as proc:
        pass
    assert proc.returncode == 3


def test_the_guard_ends_the_group_when_the_test_process_dies_inside_the_block(tmp_path: Path):
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from processes import process_group
        with process_group({TREE!r}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
            print(proc.stdout.readline().strip(), flush=True)
            os._exit(1)  # as pytest-timeout's thread method or a SIGKILL ends a test run: no teardown
    """)
    test_process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert test_process.returncode == 1, test_process.stderr
    pids = [int(p) for p in test_process.stdout.split()]
    assert len(pids) == 3, test_process.stdout
    left = _gone_within(pids, 10)
    assert left == [], f"left running after the test process died: {left}"
