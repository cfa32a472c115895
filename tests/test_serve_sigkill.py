"""A SIGKILL of ``meridian serve`` leaves nothing of its embedded Ray cluster running.

Ray ties the processes it starts for the head and the nodes to the service's life, but each raylet's dashboard and
runtime-env agents outlived a SIGKILL by ~60 s (blocked reporting the raylet's death to the dead GCS): ~1 GB on
dc-a:2,dc-b:2. The service's watchdog (``meridian.service.cluster.watchdog``) kills them. The first test runs the
real service; the others check, with stand-in processes, that the watchdog kills only what it should.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from fakes import spec
from processes import descendants, is_gone, process_line
from test_serve_process import serving

from meridian.workers.state.snapshot_paths import snapshot_dirs

CLEANUP_BOUND_S = 15


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _left_after(pids: set[int], bound_s: float) -> tuple[set[int], float]:
    """Those of ``pids`` still running after ``bound_s`` (or none, as soon as all are gone), and when it was."""
    t0 = time.monotonic()
    while (left := {p for p in pids if not is_gone(p)}) and time.monotonic() - t0 < bound_s:
        time.sleep(0.25)
    return left, time.monotonic() - t0


@pytest.mark.slow
def test_sigkilled_serve_leaves_no_embedded_cluster_process_nor_snapshot(tmp_path):
    with serving(tmp_path) as (proc, base, _):
        job = httpx.post(f"{base}/v1/jobs", json=spec(training={"steps": 100_000}), timeout=30).json()
        deadline = time.monotonic() + 120
        while len(snapshot_dirs(job["id"])) < 2:  # training, each worker keeping its state in RAM
            assert time.monotonic() < deadline, "the job's workers kept no snapshots within 120 s"
            time.sleep(0.5)
        started = descendants(proc.pid)
        agents = {p for p in started if _cmdline(p).startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))}
        assert len(agents) == 6, {p: _cmdline(p) for p in started}  # the head and two nodes, two agents each
        proc.kill()
        proc.wait(timeout=30)
        left, took = _left_after(started, CLEANUP_BOUND_S)
        assert not left, (f"{len(left)} processes of the embedded cluster still run {took:.0f} s after a SIGKILL of "
                          "the service: " + "; ".join(f"{_cmdline(p)[:80]!r} ({process_line(p)})" for p in left))
        deadline = time.monotonic() + 5  # removed right after the kills
        while snapshot_dirs(job["id"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert snapshot_dirs(job["id"]) == [], "the killed service's job left its snapshots in RAM"


# A stand-in service: it starts the watchdog, then a Ray-like process (it names the temp dir as an option's value,
# as Ray's do) with a child of its own, and a process unrelated to Ray; prints their pids, then sleeps. With "stop",
# it stops the watchdog first, as an orderly shutdown does.
SERVICE = textwrap.dedent("""
    import subprocess, sys, time
    from meridian.service.cluster import watchdog
    temp_dir, mode, snapshots = sys.argv[1], sys.argv[2], sys.argv[3]
    dog = watchdog.start(temp_dir, snapshots, "owner")
    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print(p.pid, flush=True); time.sleep(600)"
    ray_like = subprocess.Popen([sys.executable, "-c", child, f"--log_dir={temp_dir}/session_1/logs"], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"--log_dir={temp_dir}-other/logs"])
    grandchild = int(ray_like.stdout.readline())
    time.sleep(2.5)  # the watchdog scans once a second
    if mode == "stop":
        watchdog.stop(dog)
    print(dog.pid, ray_like.pid, grandchild, other.pid, flush=True)
    time.sleep(600)
""")


@contextlib.contextmanager
def stand_in_service(tmp_path: Path, mode: str):
    (tmp_path / "shm").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SERVICE, str(tmp_path / "ray"), mode,
                             str(tmp_path / "shm" / "meridian-snapshots.*.*")], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 4, "the stand-in service did not start"
        yield proc, *pids
    finally:
        for pid in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _snapshot_folder(tmp_path: Path, name: str, owner: int | None) -> Path:
    """A worker's snapshot folder as :mod:`meridian.workers.state.snapshot_paths` makes it: its owner file names the
    process that keeps it (pid and start time)."""
    folder = tmp_path / "shm" / f"meridian-snapshots.job1.{name}"
    folder.mkdir()
    (folder / "shard-000001").write_bytes(b"state")
    if owner is not None:
        started = Path(f"/proc/{owner}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (folder / "owner").write_text(f"{owner} {started}")
    return folder


def test_watchdog_kills_only_the_dead_service_ray_processes(tmp_path):
    with stand_in_service(tmp_path, "watch") as (proc, dog, ray_like, grandchild, other):
        kept_by_worker = _snapshot_folder(tmp_path, "w1", grandchild)  # a process of the cluster keeps it
        not_ours = _snapshot_folder(tmp_path, "w2", other)  # the service's child, not a Ray process
        someone_elses = _snapshot_folder(tmp_path, "w3", os.getpid())
        no_owner = _snapshot_folder(tmp_path, "w4", None)
        outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                                     f"--log_dir={tmp_path / 'ray'}/session_2/logs"])  # another cluster's, not a child
        try:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            left, _ = _left_after({dog, ray_like, grandchild}, CLEANUP_BOUND_S)
            assert not left, [process_line(p) for p in left]
            assert not is_gone(other), "a child of the service that does not run from Ray's temp dir was killed"
            assert outsider.poll() is None, "a process that is not the service's was killed"
            deadline = time.monotonic() + 5  # removed right after the kills
            while kept_by_worker.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not kept_by_worker.exists(), "a snapshot folder a process of the cluster kept is still in RAM"
            assert not_ours.exists() and someone_elses.exists() and no_owner.exists()
        finally:
            outsider.kill()
            outsider.wait()


def test_watchdog_stopped_in_order_kills_nothing(tmp_path):
    with stand_in_service(tmp_path, "stop") as (proc, dog, ray_like, grandchild, _):
        folder = _snapshot_folder(tmp_path, "w1", grandchild)
        assert is_gone(dog)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(3)  # longer than the watchdog takes (it scans once a second)
        assert not is_gone(ray_like) and not is_gone(grandchild)
        assert folder.exists()
