"""Each GPU node's device memory, read on the node, for the planner.

Without it the planner fits layouts into a guessed 40 GiB per GPU until a compute probe (``meridian probe
--compute``) has run: that refuses models an 80 GB H100 holds, and lets through layouts a 24 GB workstation
GPU cannot hold (they fail at their first step). Reading it costs one zero-CPU Ray task per GPU node, once per
node id (a node that restarts has a new id), running ``nvidia-smi``, which comes with NVIDIA's driver: no
torch, no CUDA context. A node without ``nvidia-smi`` (another vendor) or that does not answer within
``READ_TIMEOUT_S`` keeps the guess, and the plan's explanation says which it used.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time

from meridian.service.cluster.topology import ClusterTopology

QUERY = ("--query-gpu=memory.total", "--format=csv,noheader,nounits")
READ_TIMEOUT_S = 15.0
RETRY_S = 300.0
"""A node that gave no reading (no ``nvidia-smi``, or too busy to answer in time) is asked again after this long."""
MIB = 2**20


def parse_memory_total(text: str) -> list[int]:
    """Bytes per GPU from ``nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits`` (MiB, a line per
    GPU); lines that are not a number ("[N/A]") are skipped."""
    sizes = []
    for line in text.splitlines():
        line = line.strip()
        if line.isdigit():
            sizes.append(int(line) * MIB)
    return sizes


def read_here() -> int | None:
    """The smallest GPU's memory on this host in bytes, or ``None`` without ``nvidia-smi`` or a reading."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sizes = parse_memory_total(out.stdout) if out.returncode == 0 else []
    return min(sizes) if sizes else None


def read_on_nodes(node_ids: list[str], timeout_s: float = READ_TIMEOUT_S) -> dict[str, int | None]:
    """:func:`read_here` on each node, all at once; ``None`` for a node that gave no reading in time."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(read_here)
    refs = {nid: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote()
            for nid in node_ids}  # fmt: skip
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict[str, int | None] = {}
    for nid, ref in refs.items():
        out[nid] = None
        if ref not in ready:
            ray.cancel(ref, force=True)
            continue
        with contextlib.suppress(ray.exceptions.RayError):  # the task failed: no reading
            out[nid] = ray.get(ref)
    return out


class NodeGpuMemory:
    """node id → its smallest GPU's memory in bytes, for every live GPU node of a topology. A reading is kept for
    the node's life (a restarted node has a new id); a node that gave none is asked again after ``RETRY_S``, so
    planning does not wait on it every time."""

    def __init__(self, read=read_on_nodes, clock=time.monotonic) -> None:
        self._read, self._clock = read, clock
        self._known: dict[str, int] = {}
        self._unread_at: dict[str, float] = {}  # node id → when it last gave no reading
        self._lock = threading.Lock()

    def __call__(self, topo: ClusterTopology) -> dict[str, int]:
        with self._lock:
            now = self._clock()
            todo = [n.node_id for n in topo.alive_nodes if n.gpus > 0 and n.node_id not in self._known
                    and now - self._unread_at.get(n.node_id, -RETRY_S) >= RETRY_S]  # fmt: skip
            for nid, value in (self._read(todo) if todo else {}).items():
                if value is None:
                    self._unread_at[nid] = now
                else:
                    self._known[nid] = value
                    self._unread_at.pop(nid, None)
            return dict(self._known)
