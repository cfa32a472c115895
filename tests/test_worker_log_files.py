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
