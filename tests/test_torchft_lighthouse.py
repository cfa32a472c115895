"""The recovery benchmark reads why torchft's shrunk quorum formed when it did from torchft's own lighthouse log
(bench/torchft_lighthouse.py). Here a real torchft 0.2 lighthouse, in the process the benchmark starts, sees four
replica groups that heartbeat and ask for quorums the way the benchmark's replicas do, and one of them dies:
- every survivor asks at once: the quorum forms after the join timeout, the dead group still heartbeating;
- one survivor does not ask (blocked in its collective): two of four is not more than half of the groups the
  lighthouse counts alive, so the quorum waits until the dead group's heartbeat expires.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from datetime import timedelta

import pytest

from meridian.bench.torchft_lighthouse import quorums, reformed_quorum

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="torchft 0.2.0 ships one wheel, for CPython 3.11")  # fmt: skip

HEARTBEAT_TIMEOUT_MS = 1500


class _Groups:
    """Replica groups as the lighthouse sees them: a heartbeat every 100 ms from each live one (a torchft
    manager's interval), and quorum requests on demand."""

    def __init__(self, address: str, names: list[str]) -> None:
        from torchft._torchft import LighthouseClient

        self.alive = set(names)
        self._stop = threading.Event()
        self._clients = {n: LighthouseClient(address, connect_timeout=timedelta(seconds=10)) for n in names}
        self._beat()  # every group counts as alive before the first quorum
        self._beats = threading.Thread(target=self._beat_until_closed, daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        for name in list(self.alive):
            self._clients[name].heartbeat(name)

    def _beat_until_closed(self) -> None:
        while not self._stop.wait(0.1):
            self._beat()

    def ask(self, names: list[str], step: int) -> list[int]:
        """Each of ``names`` asks for a quorum at once; returns the size of the quorum each one got."""
        sizes: dict[str, int] = {}

        def one(name: str) -> None:
            q = self._clients[name].quorum(replica_id=name, timeout=timedelta(seconds=20), address=f"http://{name}:1",
                              store_address=f"{name}:2", step=step, world_size=1, shrink_only=False)  # fmt: skip
            sizes[name] = len(q.participants)

        threads = [threading.Thread(target=one, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return [sizes[n] for n in names]

    def close(self) -> None:
        self._stop.set()
        self._beats.join(5)


@pytest.fixture
def lighthouse(tmp_path):
    from meridian.bench.recovery_torchft import _Lighthouse

    lh = _Lighthouse(tmp_path, HEARTBEAT_TIMEOUT_MS)
    yield lh
    lh.stop()
    assert lh.proc.returncode == 0  # closing its stdin ended it cleanly


def _log_after(lighthouse, quorum_count: int) -> str:
    """The log once it holds ``quorum_count`` quorums (the lighthouse writes it as it goes)."""
    deadline = time.monotonic() + 5
    while len(quorums(text := lighthouse.log())) < quorum_count and time.monotonic() < deadline:
        time.sleep(0.05)
    return text


def test_every_survivor_asking_at_once_gets_a_quorum_after_the_join_timeout(lighthouse):
    groups = _Groups(lighthouse.address, ["a", "b", "c", "d"])
    try:
        assert groups.ask(["a", "b", "c", "d"], step=0) == [4, 4, 4, 4]
        groups.alive.discard("d")
        kill = time.time()
        assert groups.ask(["a", "b", "c"], step=1) == [3, 3, 3]
        log = _log_after(lighthouse, 2)
    finally:
        groups.close()
    first, second = quorums(log)
    assert (first.participants, second.participants) == (4, 3)
    assert second.quorum_id == first.quorum_id + 1
    reformed = reformed_quorum(log, kill_time=kill, full=4)
    assert reformed is not None
    assert reformed["participants"] == 3 and reformed["heartbeating"] == 4
    assert reformed["waited_for_heartbeat_timeout"] is False
    assert "join timeout" in reformed["held_by"]
    assert reformed["formed_after_kill_s"] < HEARTBEAT_TIMEOUT_MS / 1000 / 2


def test_a_survivor_that_does_not_ask_leaves_the_others_waiting_for_the_dead_groups_heartbeat(lighthouse):
    groups = _Groups(lighthouse.address, ["a", "b", "c", "d"])
    try:
        assert groups.ask(["a", "b", "c", "d"], step=0) == [4, 4, 4, 4]
        groups.alive.discard("d")  # "d" dies; "c" lives on (heartbeats) but is blocked and does not ask
        kill = time.time()
        assert groups.ask(["a", "b"], step=1) == [2, 2]
        waited = time.time() - kill
        log = _log_after(lighthouse, 2)
    finally:
        groups.close()
    reformed = reformed_quorum(log, kill_time=kill, full=4)
    assert reformed is not None
    assert reformed["participants"] == 2 and reformed["heartbeating"] == 3
    assert reformed["waited_for_heartbeat_timeout"] is True
    assert "at least half of 4" in reformed["held_by"]
    assert waited >= HEARTBEAT_TIMEOUT_MS / 1000 * 0.9
    assert reformed["formed_after_kill_s"] == pytest.approx(waited, abs=0.3)


def test_a_log_without_a_smaller_quorum_after_the_kill_gives_none():
    line = ("2026-11-29T06:43:05.186 [INFO] [torchft::lighthouse] - Quorum status: Fast quorum found! "
            "[2/2 participants healthy][2 heartbeating][shrink_only=false]\n"
            "2026-11-29T06:43:05.186 [INFO] [torchft::lighthouse] - Quorum! Quorum { quorum_id: 1, participants: "
            '[QuorumMember { replica_id: "a" }, QuorumMember { replica_id: "b" }], created: None }\n')  # fmt: skip
    (q,) = quorums("noise that is not a log line\n" + line)
    assert (q.quorum_id, q.participants, q.heartbeating, q.reason, q.held_by) == (1, 2, 2, "Fast quorum found!", None)
    assert reformed_quorum(line, kill_time=0.0, full=2) is None  # no quorum smaller than the full job
    assert reformed_quorum(line, kill_time=q.time + 1, full=3) is None  # none after the kill
