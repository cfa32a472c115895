"""Worker logs are found by the Ray worker id recorded with the rank, not by a pid glob alone: a pid reused
by another job's worker must not show that job's logs (issue 19)."""

from __future__ import annotations

import os
import threading

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
    by_node, _, gone = logs.plan_reads(placement, {"0:aa:out": 7}, ranks={0, 1}, alive_nodes={"alive-node"})
    assert [(k, off) for k, _, _, off, _ in by_node["alive-node"]] == [("0:aa:out", 7), ("0:aa:err", 0)]
    assert gone == [(1, "dead-node")]
    by_node, _, gone = logs.plan_reads(placement, {}, ranks=None, alive_nodes=None)  # no view of the cluster
    assert set(by_node) == {"alive-node", "dead-node"} and not gone


# -- following a log, without Ray: the reads run here ------------------------------------------------------------

class LocalLogs(logs.WorkerLogs):
    """WorkerLogs whose reads run in this process (every node's folder is the test's)."""

    def __init__(self):
        pass

    def _read_on_nodes(self, by_node, tail_bytes, max_bytes):
        return [logs.read_files_here(wanted, tail_bytes, max_bytes) for wanted in by_node.values()]


def _write(folder, worker, pid, first, n):
    with open(folder / f"worker-{worker}-01000000-{pid}.out", "a") as f:
        f.writelines(f"line {i:06d} {'x' * 40}\n" for i in range(first, first + n))


def _follow(job, placement, reader, until):
    """Lines of a followed log while ``until(lines)`` runs the scenario (it returns once the job is over)."""
    import asyncio
    import json
    import types

    from meridian.api.streams import follow_logs

    class Request:
        app = types.SimpleNamespace(state=types.SimpleNamespace(stopping=threading.Event()))  # the service runs on

        async def is_disconnected(self):
            return False

    store = types.SimpleNamespace(get_job=lambda job_id: types.SimpleNamespace(
        status=types.SimpleNamespace(state=types.SimpleNamespace(is_terminal=job["over"])), placement=placement[0]))
    service = types.SimpleNamespace(read_logs=lambda pl, off, tail_bytes, ranks: reader.read(
        pl, off, tail_bytes=tail_bytes, ranks=ranks))

    async def run():
        lines: list[str] = []

        async def consume():
            async for chunk in follow_logs(Request(), store, service, "j", 64 * 1024, None, poll_s=0.02):
                if chunk.strip():
                    lines.append(json.loads(chunk)["line"])

        task = asyncio.create_task(consume())
        await until(lines)
        await asyncio.wait_for(task, 30)
        return lines

    return asyncio.run(run())


def test_a_followed_log_keeps_every_line_a_job_printed_before_it_ended(tmp_path, monkeypatch):
    # One read takes at most 256 KiB a file: a job that printed 1 MB in its last second lost the rest, and the stream
    # ended as if complete.
    import asyncio

    monkeypatch.setattr(logs, "_logs_dir", lambda: str(tmp_path))
    _write(tmp_path, "aa", 100, 0, 10)
    job, placement = {"over": False}, [[{"rank": 0, "node_id": "n", "pid": 100, "ray_worker_id": "aa"}]]

    async def scenario(lines):
        while len(lines) < 10:
            await asyncio.sleep(0.01)
        _write(tmp_path, "aa", 100, 10, 20_000)  # ~1 MB, then the job ends
        job["over"] = True

    lines = _follow(job, placement, LocalLogs(), scenario)
    assert len(lines) == 20_010 and lines[-1].startswith("line 020009")


def test_a_rank_that_is_another_process_after_a_re_formation_is_read_from_its_start(tmp_path, monkeypatch):
    # Offsets were kept by rank: the new process's log was read from the old one's offset (its first lines skipped).
    import asyncio

    monkeypatch.setattr(logs, "_logs_dir", lambda: str(tmp_path))
    _write(tmp_path, "b1", 200, 0, 5_000)
    job, placement = {"over": False}, [[{"rank": 0, "node_id": "n", "pid": 200, "ray_worker_id": "b1"}]]

    async def scenario(lines):
        await asyncio.sleep(0.3)
        _write(tmp_path, "b2", 201, 900_000, 3_000)  # rank 0 is now another process, with a shorter log so far
        placement[0] = [{"rank": 0, "node_id": "n", "pid": 201, "ray_worker_id": "b2"}]
        await asyncio.sleep(0.3)
        job["over"] = True

    lines = _follow(job, placement, LocalLogs(), scenario)
    assert len([line for line in lines if line.startswith("line 9")]) == 3_000


def test_a_tail_larger_than_one_read_ends_at_the_newest_line(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "_logs_dir", lambda: str(tmp_path))
    _write(tmp_path, "cc", 300, 0, 40_000)  # ~2 MB
    placement = [{"rank": 0, "node_id": "n", "pid": 300, "ray_worker_id": "cc"}]
    for tail_kb in (64, 1024):
        entries, _ = LocalLogs().read(placement, None, tail_bytes=tail_kb * 1024)
        # before: 1024 KiB of tail gave the oldest 256 KiB of that window, lines 20216..25160
        assert entries[-1].line.startswith("line 039999") and len(entries) > tail_kb * 1024 // 60
