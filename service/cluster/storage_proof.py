"""Proof that the jobs' checkpoint storage is one store for every node that may run a rank: each node's worker
writes a token through it, every other node and the service read the tokens back.

A storage that only looks shared (the default ``~/.meridian/checkpoints`` on each machine of a multi-node
cluster, a mount missing on one node) would let a job commit a DCP checkpoint whose shards lie on different
machines, which neither a resume nor an export can read, and only after hours of training. So the service
proves it when it starts (in the background: a start does not wait for it) and again when a multi-node job is
submitted on nodes not proven yet; a job whose nodes do not share it is refused with the fix
(:class:`StorageNotShared`, a 409). Deciding is :func:`verdict`, a pure function of what was written and what
was read; :func:`prove` runs the tasks (one per node and round, none holding a CPU, each with a timeout).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.errors import Unschedulable
from meridian.workers.state import storage

log = logging.getLogger(__name__)

TASK_TIMEOUT_S = 60.0
"""How long one round of the proof's tasks may take (a node's worker process may have to start first)."""
SERVICE = "the service"
"""The reader name of the service's own process in a verdict."""


class StorageNotShared(Unschedulable):
    """The storage is not one store for every node a job may run on (or for the service)."""


@dataclass(frozen=True)
class Verdict:
    """What one proof found."""

    root: str
    nodes: tuple[str, ...]
    """The nodes (ids) whose workers took part."""
    unseen: tuple[tuple[str, str], ...] = ()
    """``(writer, reader)``: a token the writer wrote that the reader (a node id, or :data:`SERVICE`) did not read."""
    failed: tuple[tuple[str, str], ...] = ()
    """``(node, error)``: a node whose worker could not write or read the storage at all."""

    @property
    def shared(self) -> bool:
        return not self.unseen and not self.failed

    def message(self) -> str:
        """What was found and the fix, for a person."""
        said = [f"node {n[:12]} could not use it ({why})" for n, why in self.failed]
        by_reader: dict[str, list[str]] = {}
        for writer, reader in self.unseen:
            by_reader.setdefault(reader, []).append(writer[:12])
        said += [f"{reader if reader == SERVICE else 'node ' + reader[:12]} did not see what node(s) "
                 f"{', '.join(writers)} wrote" for reader, writers in by_reader.items()]
        return (f"the checkpoint storage {self.root} is not shared by the nodes a multi-node job runs on: "
                f"{'; '.join(said)}. Each node would write its checkpoint shards to its own disk, which no resume "
                "or export can read. Start the service with `meridian serve --storage s3://BUCKET/PREFIX` (an "
                "object store every node reaches, credentials in each node's environment) or with --storage on a "
                "filesystem mounted at the same path on every node and the service's machine")


def verdict(root: str, written: dict[str, str], seen: dict[str, dict[str, bool]],
            failed: dict[str, str]) -> Verdict:
    """``written``: node → the name of its token; ``seen``: reader (node or :data:`SERVICE`) → token name → read
    back; ``failed``: node → why its worker could not write or read at all."""
    unseen = tuple(sorted((writer, reader) for reader, names in seen.items()
                          for writer, name in written.items() if writer != reader and not names.get(name)))
    nodes = tuple(sorted(set(written) | set(failed)))
    return Verdict(root=root, nodes=nodes, unseen=unseen, failed=tuple(sorted(failed.items())))


def job_nodes(datacenters: Iterable[str], topo: ClusterTopology) -> list[str]:
    """The live nodes of a job's ``datacenters`` that can hold a worker."""
    return sorted(n.node_id for dc in datacenters for n in topo.nodes_in(dc) if n.cpus > 0 or n.gpus > 0)


def worker_nodes(topo: ClusterTopology) -> list[str]:
    """Every live node of a datacenter that can hold a worker (the service's start proves them all)."""
    return sorted(n.node_id for n in topo.alive_nodes if n.datacenter and (n.cpus > 0 or n.gpus > 0))


def prove(root: str, node_ids: Iterable[str], *, timeout_s: float = TASK_TIMEOUT_S) -> Verdict:
    """Each node writes a token under ``root``, then every node and this process read them all; the tokens are
    removed after. Ray must be connected."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(set(node_ids))
    nonce = uuid.uuid4().hex[:16]

    def on(node: str, fn: Callable, *args: object) -> object:
        task = ray.remote(num_cpus=0, max_retries=0)(fn)
        return task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)

    def gather(refs: dict[str, object]) -> tuple[dict[str, object], dict[str, str]]:
        deadline = time.monotonic() + timeout_s
        done, failed = {}, {}
        for node, ref in refs.items():
            try:
                done[node] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                failed[node] = f"its worker did not answer within {timeout_s:.0f} s"
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            except Exception as e:  # noqa: BLE001 - the task's own error (a write refused, an unreachable URL)
                cause = getattr(e, "cause", None) or e
                failed[node] = f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1][:300]}"
        return done, failed

    written, failed = gather({n: on(n, storage.write_token, root, nonce, n) for n in nodes})
    names = [str(v) for v in written.values()]
    seen_by, read_failed = gather({n: on(n, storage.read_tokens, root, nonce, names) for n in written})
    failed.update(read_failed)
    seen: dict[str, dict[str, bool]] = {n: dict(v) for n, v in seen_by.items()}  # type: ignore[call-overload]
    seen[SERVICE] = storage.read_tokens(root, nonce, names)
    result = verdict(root, {n: str(v) for n, v in written.items()}, seen, failed)
    if result.shared:
        storage.remove_tokens(root, names)
    else:  # each node removes its own, the only one it can be sure to see
        cleanup = {n: on(n, storage.remove_tokens, root, [str(name)]) for n, name in written.items()}
        gather(cleanup)
        storage.remove_tokens(root, names)
    return result


@dataclass
class SharedStorage:
    """The proofs of one storage root: which nodes are known to share it, proven again only for new ones."""

    root: str
    prove: Callable[[str, list[str]], Verdict] = field(default=prove)
    proven: set[str] = field(default_factory=set)
    last: Verdict | None = None
    """The last proof that failed, until a proof of all its nodes succeeds."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def require(self, node_ids: Iterable[str]) -> None:
        """Raise :class:`StorageNotShared` unless every node of ``node_ids`` and the service share the storage;
        nodes proven before are not asked again, but one of them takes part with the new ones."""
        nodes = set(node_ids)
        with self._lock:
            new = nodes - self.proven
            if not new:
                return
            result = self.prove(self.root, sorted(new | set(sorted(nodes & self.proven)[:1])))
            if not result.shared:
                self.last = result
                raise StorageNotShared(result.message())
            if self.last is not None and set(self.last.nodes) <= set(result.nodes):
                self.last = None  # the nodes it was about are proven now (a mount was fixed)
            self.proven |= set(result.nodes)

    def status(self) -> dict[str, object]:
        """What is known now: the storage, the nodes proven to share it, and the last failed proof's finding."""
        return {"root": self.root, "proven_nodes": sorted(self.proven),
                "not_shared": self.last.message() if self.last is not None else ""}

    def require_for(self, datacenters: Iterable[str], topo: ClusterTopology) -> None:
        """:meth:`require` for the nodes a job planned on ``datacenters`` may run its ranks on: every live node of
        them that has a CPU or GPU (a replacement may land on any of them)."""
        self.require(job_nodes(datacenters, topo))

    def start_background(self, node_ids: Callable[[], Iterable[str]]) -> threading.Thread:
        """Prove the storage for the nodes there now, on a thread (the service's start does not wait); a failure
        is logged and kept in :attr:`last`, and a job on those nodes is refused when submitted."""

        def run() -> None:
            try:
                self.require(node_ids())
            except StorageNotShared as e:
                log.error("%s", e)
            except Exception:  # noqa: BLE001 - admission proves again
                log.exception("proving the checkpoint storage shared failed")

        thread = threading.Thread(target=run, name="meridian-storage-proof", daemon=True)
        thread.start()
        return thread
