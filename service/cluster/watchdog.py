"""After a SIGKILL of the service, kill what its embedded Ray cluster left running.

Why: Ray starts the head's and the nodes' own processes (gcs_server, raylets, dashboard, monitors) tied to the
service's life (``PR_SET_PDEATHSIG``), so a SIGKILL of ``meridian serve`` takes them along. Each raylet starts a
``ray::DashboardAgent`` and a ``ray::RuntimeEnvAgent`` itself, without that tie: they are reparented to init.
They notice their raylet's end at once (a pipe), then report "Raylet is terminated. Termination is unexpected"
to the GCS, which died too, with a fixed 60 s timeout (``ray._private.utils.publish_error_to_driver``), and exit
only after it. Measured (ray 2.60, 2-core host, idle cluster): dc-a:2,dc-b:2 left 10 agents, ~1 GB, still alive
60 s after the SIGKILL; dc-a:1,dc-b:1 left 6, gone after 61 s. A SIGTERM or Ctrl-C stops them through
``Cluster.shutdown()``; a SIGKILL runs no code of the service.

What: :func:`start` launches this file as a small separate process (the standard library only, 11 MB, in its
own session so that a terminal's Ctrl-C or hang-up does not reach it). While the service lives it records, once
a second, every process below the service's children that run Ray from Ray's temp dir (they name it, or a path
below it, as an option's value: ``--log_dir=/tmp/ray/session_…/logs``), with each one's start time. When the
service is gone (its parent pid changes) it SIGKILLs the recorded processes that still run, and whatever runs
below them, then removes the in-memory snapshot folders those processes kept (a training job's workers keep
one each in ``/dev/shm``, the size of their state: otherwise RAM until the service's next start swept them), and
exits: measured, the last process of the cluster was gone 0.8-0.9 s after the SIGKILL (idle, or training a job). Its cost while the service runs: a ~1 ms scan a second, ~1 ms added to the start. A process is
killed only if its start time still matches (a pid the kernel gave to someone else is left alone), and through a
pidfd where the kernel has them. It never looks at processes by name, nor at other clusters: only at what runs
below this service's children. Not covered: a process started less than a second before the SIGKILL by one that
then died with the service (only a raylet's newest workers could be that, and Ray's workers, runner and training
processes exit by themselves 1-2.5 s after their raylet: measured).

:func:`stop` ends it after an orderly shutdown (it then kills nothing). It is started only for the embedded
cluster, never for a cluster the service merely connects to (``--address``).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

SCAN_INTERVAL_S = 1.0  # a /proc scan costs ~1 ms of CPU with ~100 processes on the host


def start(ray_temp_dir: str, snapshots: str = "", owner_file: str = "owner") -> subprocess.Popen | None:
    """Watch this process (Linux only: it reads /proc); returns the watchdog for :func:`stop`. ``snapshots``: the
    glob of the workers' in-memory snapshot folders (:mod:`meridian.workers.state.snapshot_paths`), each naming the
    process that keeps it in its ``owner_file``; empty: none are removed."""
    if not sys.platform.startswith("linux"):
        return None
    # -I -S: the file runs by its path, with no site packages (a ~20 ms start, nothing of the service imported)
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), ray_temp_dir, snapshots, owner_file]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


def stop(watchdog: subprocess.Popen | None) -> None:
    """End the watchdog without a sweep (the cluster was shut down in order)."""
    if watchdog is not None and watchdog.poll() is None:
        watchdog.terminate()  # SIGTERM's default action: it has no handler, and kills nothing
        try:
            watchdog.wait(timeout=5)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()


def watch(service_pid: int, ray_temp_dir: str, snapshots: str = "", owner_file: str = "owner") -> None:
    """Record the service's Ray processes until it is gone, then kill those still running and remove the snapshot
    folders they kept."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    seen: dict[int, int] = {}  # pid → start time (clock ticks after boot)
    ever: set[tuple[int, int]] = set()  # every (pid, start time) seen: a worker that died left its folder for a new one
    temp_dir = os.fsencode(ray_temp_dir.rstrip("/"))
    while os.getppid() == service_pid:  # our parent: once it dies, we are given to init (or a subreaper)
        table = _processes()
        roots = [pid for pid, (ppid, _) in table.items() if ppid == service_pid and _runs_from(pid, temp_dir)]
        # kept while they run, even once their parent is gone (a removed node's agents are init's children)
        seen = {pid: started for pid, started in seen.items() if table.get(pid, (0, None))[1] == started}
        seen.update((pid, table[pid][1]) for pid in _below(roots, table))
        ever.update(seen.items())
        time.sleep(SCAN_INTERVAL_S)
    table = _processes()
    alive = [pid for pid, started in seen.items() if pid in table and table[pid][1] == started]
    for pid in _below(alive, table):
        _kill(pid, table[pid][1])
    if snapshots:
        _remove_snapshots(snapshots, owner_file, ever)


def _remove_snapshots(pattern: str, owner_file: str, kept_by: set[tuple[int, int]]) -> None:
    """Remove the snapshot folders that a process of this cluster kept, alive or not (its pid and start time in the
    folder's owner file): the service would sweep them at its next start, and until then they hold RAM. Folders of other
    services' workers, or naming no owner, are left."""
    for folder in glob.glob(pattern):
        try:
            with open(os.path.join(folder, owner_file)) as f:
                pid, started = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
        if (pid, started) in kept_by:
            shutil.rmtree(folder, ignore_errors=True)


def _processes() -> dict[int, tuple[int, int]]:
    """Every process on the host: pid → (parent pid, start time)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                out[int(name)] = stat
    return out


def _stat(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold spaces
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _runs_from(pid: int, temp_dir: bytes) -> bool:
    """An option's value is Ray's temp dir or a path below it (``--temp-dir=/tmp/ray``, ``--log_dir=/tmp/ray/…``):
    how each process Ray starts for a node names its session."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    values = (arg.partition(b"=")[2] for arg in argv if arg.startswith(b"--"))
    return any(v == temp_dir or v.startswith(temp_dir + b"/") for v in values)


def _below(roots: list[int], table: dict[int, tuple[int, int]]) -> list[int]:
    """``roots`` and every process below them in ``table``."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return sorted(found)


def _kill(pid: int, started: int) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``started``."""
    try:
        fd = os.pidfd_open(pid)  # pins the process: the check below cannot be raced by a reused pid
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3)
        fd = None
    try:
        stat = _stat(pid)
        if stat is not None and stat[1] == started:
            if fd is None:
                os.kill(pid, signal.SIGKILL)
            else:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        if fd is not None:
            os.close(fd)


if __name__ == "__main__":
    watch(int(sys.argv[1]), *sys.argv[2:])
