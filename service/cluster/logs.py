"""Worker logs: read what a job's Ray Train workers printed, from the node each worker runs on.

Ray writes every worker process's stdout and stderr to ``<session>/logs/worker-<id>-<job>-<pid>.out|.err``
on that worker's node. The job's placement records each rank's node, pid and Ray worker id, so a tiny task pinned to that
node (``num_cpus=0``: it runs even when training holds every CPU) reads the files from a byte offset. The
caller keeps the offsets, so following a log is repeated reads that never repeat or skip a byte.
Chosen over ``ray.util.state.get_log`` because that needs the dashboard, which clusters may run without.
"""

from __future__ import annotations

import glob
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from meridian.service.errors import ClusterUnavailable

STREAMS = ("out", "err")
READ_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class LogEntry:
    rank: int
    stream: str
    line: str


def _logs_dir() -> str:
    """This process's Ray logs folder: where its own stdout goes (Ray redirects worker stdout there)."""
    try:
        import ray._private.worker as rw

        return rw._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - private API; fall back to the file behind our own stdout
        return os.path.dirname(os.readlink("/proc/self/fd/1"))


def read_files_here(wanted: list[tuple[str, int, str, int | None, str]], tail_bytes: int, max_bytes: int) -> list[tuple[str, int, str]]:
    """For (key, pid, stream, offset, ray worker id) read ``worker-<ray worker id>-*-<pid>.<stream>`` in this
    node's logs folder from ``offset`` (``None``: the last ``tail_bytes``, whatever ``max_bytes`` says: the
    newest lines, not the oldest of a window larger than one read), at most ``max_bytes``, ending on a whole
    line. The Ray worker id names the very process: a pid alone may have been reused by another
    job's worker. Without one (a worker of an older release) the newest file of the pid is read.
    Returns (key, new offset, text)."""
    logs = _logs_dir()
    out = []
    for key, pid, stream, offset, worker in wanted:
        worker = worker if worker and all(c in "0123456789abcdef" for c in worker) else "*"
        paths = glob.glob(os.path.join(logs, f"worker-{worker}-*-{int(pid)}.{stream}"))
        if not paths:
            out.append((key, offset or 0, ""))
            continue
        path = max(paths, key=os.path.getmtime)
        size = os.path.getsize(path)
        start = max(0, size - tail_bytes) if offset is None else min(offset, size)
        limit = max(max_bytes, tail_bytes) if offset is None else max_bytes
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(limit)
        if offset is None and start > 0:
            skip = data.find(b"\n") + 1  # a tail starts mid-line: drop the fragment
            data, start = data[skip:], start + skip
        cut = data.rfind(b"\n") + 1  # keep a partial last line for the next read ...
        if cut == 0 and len(data) >= limit:
            cut = len(data)  # ... unless one line is longer than max_bytes: hand it over in pieces
        data = data[:cut]
        out.append((key, start + len(data), data.decode("utf-8", errors="replace")))
    return out


def plan_reads(
    placement: list[dict[str, Any]], offsets: dict[str, int], *, ranks: set[int] | None, alive_nodes: set[str] | None,
) -> tuple[dict[str, list[tuple[str, int, str, int | None, str]]], dict[str, int], list[tuple[int, str]]]:
    """What to read on which node: ``(by node: (key, pid, stream, offset, ray worker id)), (key → rank),
    [(rank, node) of ranks left out because their node is not alive]``. Empty ``offsets``: a first read (the
    tail). Pure, so what is asked of which node is tested without Ray."""
    first = not offsets
    by_node: dict[str, list[tuple[str, int, str, int | None, str]]] = defaultdict(list)
    ranks_of: dict[str, int] = {}
    gone: list[tuple[int, str]] = []
    for p in placement:
        if ranks is not None and p["rank"] not in ranks or not p.get("pid"):
            continue
        if alive_nodes is not None and p["node_id"] not in alive_nodes:
            gone.append((p["rank"], p["node_id"]))
            continue
        for stream in STREAMS:
            # Keyed by the process, not the rank alone: after a re-formation a rank is another process with a log
            # of its own, which is read from its start, not from the old one's offset.
            key = f"{p['rank']}:{p.get('ray_worker_id') or p['pid']}:{stream}"
            ranks_of[key] = p["rank"]
            by_node[p["node_id"]].append((key, p["pid"], stream, None if first else offsets.get(key, 0),
                                          str(p.get("ray_worker_id") or "")))
    return by_node, ranks_of, gone


class WorkerLogs:
    """Reads a job's worker logs on the nodes where its ranks run."""

    def __init__(self) -> None:
        import ray

        self._read = ray.remote(num_cpus=0, max_retries=0)(read_files_here)

    def read(
        self, placement: list[dict[str, Any]], offsets: dict[str, int] | None, *, tail_bytes: int = 64 * 1024,
        max_bytes: int = 256 * 1024, ranks: set[int] | None = None, alive_nodes: set[str] | None = None,
    ) -> tuple[list[LogEntry], dict[str, int]]:
        """New log lines of every rank since ``offsets`` (``None``: the tail), and the offsets to pass next.
        A rank on a node outside ``alive_nodes`` is not read (its logs died with it; a first read says so)."""
        offsets = dict(offsets or {})
        first = not offsets
        by_node, ranks_of, gone = plan_reads(placement, offsets, ranks=ranks, alive_nodes=alive_nodes)
        results = self._read_on_nodes(by_node, tail_bytes, max_bytes)
        entries: list[LogEntry] = []
        if first:
            entries += [LogEntry(rank, "err", f"(meridian: node {node[:12]} is no longer alive; this rank's logs "
                                 "were on it)") for rank, node in gone]  # fmt: skip
        for result in results:
            for key, offset, text in result:
                offsets[key] = offset
                entries += [LogEntry(ranks_of[key], key.rsplit(":", 1)[1], line) for line in text.splitlines()]
        entries.sort(key=lambda e: (e.rank, e.stream))
        return entries, offsets

    def _read_on_nodes(self, by_node: dict[str, list[tuple[str, int, str, int | None, str]]], tail_bytes: int,
                       max_bytes: int) -> list[list[tuple[str, int, str]]]:
        """:func:`read_files_here` on each node, in a task pinned to it."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs = [
            self._read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
                wanted, tail_bytes, max_bytes)
            for node_id, wanted in by_node.items()
        ]
        try:
            return ray.get(refs, timeout=READ_TIMEOUT_S) if refs else []
        except (ray.exceptions.RayError, TimeoutError) as e:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise ClusterUnavailable(
                f"could not read worker logs on nodes {sorted(n[:12] for n in by_node)} within {READ_TIMEOUT_S:.0f} s "
                f"({type(e).__name__}); a node may be down — GET /v1/cluster shows which") from None
