"""``run_processes``: ranks forked from the zygote, with the caller's environment, directory and output at the
call, and a failing rank named."""

from __future__ import annotations

import os

import pytest

from meridian.workers.distributed.multiproc import RankFailed, run_processes


def _where(rank, world):
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "env": os.environ.get("MERIDIAN_TEST_MARK"),
            "cwd": os.getcwd(), "parent": os.getppid()}  # fmt: skip


def _say_on_both_streams(rank, world):
    os.write(1, f"rank {rank} on stdout\n".encode())
    os.write(2, f"rank {rank} on stderr\n".encode())


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 was told to fail")
    return rank


def test_ranks_see_the_callers_environment_and_directory_at_the_call(monkeypatch, tmp_path):
    first = run_processes(_where, 2)  # the zygote starts here, with the environment as it is now
    assert [r["rank"] for r in first] == [0, 1] and all(r["world"] == 2 for r in first)
    assert all(r["parent"] != os.getpid() for r in first)  # forked by the zygote, not by this process
    monkeypatch.setenv("MERIDIAN_TEST_MARK", "set-after-the-zygote-started")
    monkeypatch.chdir(tmp_path)
    later = run_processes(_where, 2)
    assert [r["env"] for r in later] == ["set-after-the-zygote-started"] * 2
    assert [r["cwd"] for r in later] == [str(tmp_path)] * 2


def test_ranks_write_where_the_caller_writes_now(capfd):
    with capfd.disabled():  # the zygote may start here, on the terminal's descriptors
        run_processes(_where, 2)
    run_processes(_say_on_both_streams, 2)
    out, err = capfd.readouterr()
    assert "rank 0 on stdout" in out and "rank 1 on stdout" in out, out
    assert "rank 0 on stderr" in err and "rank 1 on stderr" in err, err


def test_a_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 failed:(.|\n)*rank 1 was told to fail"):
        run_processes(_fail_on_rank_1, 2, timeout_s=60)


_CALLER = r"""
import sys, time
from meridian.workers.distributed.multiproc import run_processes

def linger(rank, world, folder):
    import os, pathlib
    pathlib.Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    run_processes(linger, 2, sys.argv[1], timeout_s=300)
"""


def test_ranks_exit_when_their_caller_is_killed(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and caller.poll() is None:
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
        assert len(pids) == 2, "the ranks never started"
        caller.send_signal(signal.SIGKILL)  # no clean-up of the caller's runs
        caller.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "a rank outlived its caller"
    finally:
        caller.kill()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False
