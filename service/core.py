"""The control plane as one object: store + Ray connection + launcher + supervisor, started and stopped
together. The API holds one :class:`MeridianService`; so do the tests that skip HTTP.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from meridian.service.cluster.connect import LocalCluster, connect
from meridian.service.cluster.gpu_memory import NodeGpuMemory
from meridian.service.cluster.link_probe import ProbeCache, run_compute_probe, run_probe, training_precision
from meridian.service.cluster.logs import LogEntry, WorkerLogs
from meridian.service.cluster.storage_proof import SharedStorage, worker_nodes
from meridian.service.cluster.topology import ClusterTopology, read_topology
from meridian.service.data_access import DEFAULT_MAX_BYTES, DataAccess
from meridian.service.errors import MeridianError
from meridian.service.jobs import JobRequest, JobState
from meridian.service.launcher import Launcher
from meridian.service.lease import DatabaseOwned, Lease
from meridian.service.model_access import ModelAccess
from meridian.service.planning.placement import worker_slots
from meridian.service.store import JobStore
from meridian.service.supervision.reconcile import DEFAULT_MAX_RELAUNCHES
from meridian.service.supervision.supervisor import Supervisor
from meridian.workers.contracts.fields import to_plain
from meridian.workers.state import storage
from meridian.workers.state.snapshot_paths import remove_snapshot_dirs

log = logging.getLogger(__name__)


class StorageUnusable(MeridianError):
    """The storage folder for checkpoints and final weights cannot be made or written."""


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    data_dir: str = field(default_factory=lambda: os.path.expanduser("~/.meridian"))
    """Database, checkpoints and Ray Train run folders live here."""
    database_url: str = ""
    """SQLAlchemy URL of the job store; empty: ``sqlite:///<data_dir>/meridian.db``."""
    ray_address: str | None = None
    """Existing cluster to join (``None``: ``RAY_ADDRESS`` / a local ``ray start``)."""
    local_datacenters: dict[str, int] | None = None
    """Start an embedded cluster with these simulated datacenters (name → nodes) instead."""
    cpus_per_node: int = 1
    poll_interval_s: float = 0.5
    data_roots: tuple[str, ...] = ()
    """Folders whose files jobs may name as ``data.source`` or ``data.dataset``, and URL prefixes
    (``s3://bucket/prefix``) under which ``data.dataset`` may name prepared datasets; empty: ``<data_dir>/data``
    (not ``data_dir`` itself, which holds the database and, by default, the token file)."""
    tracking_roots: tuple[str, ...] = ()
    """Folders (and ``https://`` MLflow servers) where a job's MLflow store may be; empty: ``<data_dir>/tracking``."""
    data_max_bytes: int = DEFAULT_MAX_BYTES
    """The most ``data.max_bytes`` a job may ask for."""
    storage: str = ""
    """Where jobs' checkpoints and final weights go (``<storage>/<job id>/``): a path every node and the
    service can read and write, e.g. a shared filesystem's mount, or an fsspec URL (``s3://bucket/prefix``;
    credentials from the environment); empty: ``<data_dir>/checkpoints``, which on one machine every node
    shares."""
    model_modules: tuple[str, ...] = ()
    """Modules whose factories jobs may name as ``model.factory`` (``--model-module``; :mod:`.model_access`)."""
    max_relaunches: int = DEFAULT_MAX_RELAUNCHES
    """Times a job whose runner actor is lost (its node died, the Ray cluster restarted) is queued again to run
    from its newest checkpoint before it fails (``--max-relaunches``; 0: it fails at once)."""

    def __post_init__(self) -> None:
        ModelAccess(self.model_modules)  # a module name that is not one is refused at start
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")
        if self.cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be >= 1, got {self.cpus_per_node}")
        if not 0 <= self.max_relaunches <= 1000:
            raise ValueError(f"max_relaunches (--max-relaunches) must be between 0 and 1000, got {self.max_relaunches}")
        if storage.is_url(self.storage):
            storage.check_url(self.storage)  # a ValueError naming the scheme or the package to install
        elif self.storage and not os.path.isabs(os.path.expanduser(self.storage)):
            raise ValueError(f"storage {self.storage!r} must be an absolute path (every node resolves it alike)")
        self.data_access()  # a URL data root written wrongly (s3://b/x/../y) is refused before anything starts

    @property
    def checkpoint_root(self) -> str:
        """The folder (or URL) of every job's checkpoints (``<job id>/step-*``)."""
        if storage.is_url(self.storage):
            return self.storage.rstrip("/")
        return str(Path(os.path.expanduser(self.storage) or Path(self.data_dir) / "checkpoints").resolve())

    @property
    def effective_data_roots(self) -> tuple[str, ...]:
        return self.data_roots or (str(Path(self.data_dir) / "data"),)

    def data_access(self) -> DataAccess:
        return DataAccess.for_roots(self.effective_data_roots, max_bytes=self.data_max_bytes,
                                    tracking_roots=self.tracking_roots or (str(Path(self.data_dir) / "tracking"),),
                                    storage_root=self.checkpoint_root)

    def model_access(self) -> ModelAccess:
        return ModelAccess(self.model_modules)

    def check_storage(self) -> None:
        """Make the storage folder and prove this process can write there, or raise :class:`StorageUnusable`
        saying what to fix (before any job is accepted, not when its first checkpoint fails)."""
        root = self.checkpoint_root
        try:
            storage.probe_writable(root)
        except OSError as e:
            if not storage.is_url(root):
                raise StorageUnusable(f"storage folder {root} is not writable ({e.strerror or e}); give --storage "
                                      "a folder this service and every node can write") from e
            raise StorageUnusable(_url_unusable(root, e)) from e
        except Exception as e:  # an object store's library raises its own types too
            if not storage.is_url(root):
                raise
            raise StorageUnusable(_url_unusable(root, e)) from e

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{Path(self.data_dir) / 'meridian.db'}"


def _url_unusable(root: str, e: BaseException) -> str:
    return (f"storage {root} is not writable ({type(e).__name__}: {e}); the service and every node read "
            "credentials and endpoint from their environment (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
            "AWS_ENDPOINT_URL or AWS_PROFILE; the bucket must exist), so set them where the service and the Ray "
            "cluster start, or give --storage another location")


class MeridianService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.local_cluster: LocalCluster | None = None
        self.store: JobStore | None = None
        self.supervisor: Supervisor | None = None
        self.probe_cache: ProbeCache | None = None
        self.worker_logs: WorkerLogs | None = None
        self.lease: Lease | None = None
        self.shared_storage: SharedStorage | None = None

    def start(self) -> MeridianService:
        cfg = self.config
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
        cfg.check_storage()
        # The database first: a service refused by another one's lease starts no cluster.
        self.store = JobStore(cfg.db_url)
        self.lease = Lease(self.store.engine)
        try:
            self.lease.acquire()
        except DatabaseOwned:
            self.store.close()
            self.store = None
            raise
        if not cfg.data_roots:
            Path(cfg.effective_data_roots[0]).mkdir(exist_ok=True)
        address = cfg.ray_address
        if cfg.local_datacenters:
            self.local_cluster = LocalCluster(cfg.local_datacenters, cpus_per_node=cfg.cpus_per_node)
            address = self.local_cluster.start()
        connect(address)
        # Proven shared by every worker node in the background now, and by a job's nodes when it is submitted.
        self.shared_storage = SharedStorage(cfg.checkpoint_root)
        self.shared_storage.start_background(lambda: worker_nodes(read_topology()))
        self.probe_cache = ProbeCache(cfg.data_dir)
        launcher = Launcher(storage_path=str(Path(cfg.data_dir).resolve() / "ray-train"))
        self.supervisor = Supervisor(
            self.store, launcher, read_topology,
            checkpoint_root=cfg.checkpoint_root, poll_interval_s=cfg.poll_interval_s,
            probe_report=self.probe_cache.latest, data_access=cfg.data_access(), lease=self.lease,
            gpu_memory=NodeGpuMemory(), storage_check=self.shared_storage.require_for,
            max_relaunches=cfg.max_relaunches,
        )
        self.worker_logs = WorkerLogs()
        self.supervisor.start()
        return self

    def read_logs(self, placement: list[dict], offsets: dict[str, int] | None, *, tail_bytes: int,
                  ranks: set[int] | None = None) -> tuple[list[LogEntry], dict[str, int]]:
        """New worker log lines since ``offsets`` (see :class:`~meridian.service.cluster.logs.WorkerLogs`)."""
        alive = {n.node_id for n in read_topology().alive_nodes}  # no read is pinned to a node that died
        return self.worker_logs.read(placement, offsets, tail_bytes=tail_bytes, ranks=ranks,  # type: ignore[union-attr]
                                     alive_nodes=alive)

    def topology(self) -> ClusterTopology:
        return read_topology()

    def probe_links(self, tiers: tuple[str, ...], max_bytes: int) -> dict:
        """Run the collective benchmark on every link tier now; the result also feeds the planner."""
        report = run_probe(read_topology(), tiers=tiers, max_bytes=max_bytes)
        return self.probe_cache.store(report)  # type: ignore[union-attr]

    def probe_compute(self, request: JobRequest) -> dict:
        """Measure forward + backward of ``request``'s model and micro-batch on every worker slot of the
        datacenters it may use, all at once (as training runs); plans of that shape use the figure from now on."""
        topo = read_topology()
        use_gpu = topo.has_gpus(tuple(request.topology.datacenters or topo.datacenters))
        slots = {n.node_id: worker_slots(n, use_gpu=use_gpu) for n in topo.alive_nodes}
        entry = run_compute_probe(topo, to_plain(request.model), request.micro_batch, slots=slots, use_gpu=use_gpu,
                                  precision=training_precision(request.precision.value, use_gpu))
        self.probe_cache.store_compute(entry)  # type: ignore[union-attr]
        return entry

    def stop(self) -> None:
        import ray

        if self.supervisor is not None:
            self.supervisor.stop()
        unfinished = self._unfinished_jobs() if self.local_cluster is not None else []
        if self.lease is not None and self.store is not None:
            with contextlib.suppress(Exception):
                self.lease.release()
        if self.store is not None:
            self.store.close()
        if ray.is_initialized():
            ray.shutdown()
        if self.local_cluster is not None:
            self.local_cluster.shutdown()
            # Their workers were this cluster's processes, killed with it: their snapshots in RAM (a shard per
            # worker, weights and AdamW state) would stay until the host reboots. Nothing can resume from them:
            # a job whose cluster went is relaunched from its durable checkpoint when the service starts again.
            for job_id in unfinished:
                remove_snapshot_dirs(job_id)

    def _unfinished_jobs(self) -> list[str]:
        if self.store is None:
            return []
        states = {s for s in JobState if not s.is_terminal}
        with contextlib.suppress(Exception):  # a store that fails now must not stop the cluster's shutdown
            return [job.id for job in self.store.list_jobs(states=states, limit=1_000_000)]
        return []
