"""Worker logs are found by the Ray worker id recorded with the rank, not by a pid glob alone: a pid reused
by another job's worker must not show that job's logs (issue 19)."""

from __future__ import annotations

import os

from meridian.service.cluster import logs


def test_the_log_of_the_ranks_own_worker_is_read_even_when_its_pid_was_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "_logs_dir", lambda: str(tmp_path))
    mine = tmp_path / "worker-aa11-01000000-4242.out"
    mine.write_text("my job's line\n")
    other = tmp_path / "worker-bb22-02000000-4242.out"  # a later worker of another job got the same pid
    other.write_text("another job's secret\n")
    os.utime(mine, (1, 1))
    (key, _, text), = logs.read_files_here([("0:out", 4242, "out", None, "aa11")], 1024, 1024)
    assert text == "my job's line\n"
    (_, _, unknown), = logs.read_files_here([("0:out", 4242, "out", None, "../x")], 1024, 1024)
    assert unknown == "another job's secret\n"  # no usable id (an older worker): the newest file of the pid


def test_no_read_is_pinned_to_a_node_that_died_and_a_first_read_names_it():
    placement = [{"rank": 0, "node_id": "alive-node", "pid": 10, "ray_worker_id": "aa"},
                 {"rank": 1, "node_id": "dead-node", "pid": 11, "ray_worker_id": "bb"},
                 {"rank": 2, "node_id": "alive-node", "pid": 12}]
    by_node, ranks_of, gone = logs.plan_reads(placement, {}, ranks=None, alive_nodes={"alive-node"})
    assert set(by_node) == {"alive-node"}
    assert sorted(ranks_of.values()) == [0, 0, 2, 2]
    assert gone == [(1, "dead-node")]
    assert {offset for _, _, _, offset, _ in by_node["alive-node"]} == {None}  # a first read: the tail
    by_node, _, gone = logs.plan_reads(placement, {"0:out": 7}, ranks={0, 1}, alive_nodes={"alive-node"})
    assert [(k, off) for k, _, _, off, _ in by_node["alive-node"]] == [("0:out", 7), ("0:err", 0)]
    assert gone == [(1, "dead-node")]
    by_node, _, gone = logs.plan_reads(placement, {}, ranks=None, alive_nodes=None)  # no view of the cluster
    assert set(by_node) == {"alive-node", "dead-node"} and not gone
