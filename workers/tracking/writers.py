"""One writer per tracker, each through its own library: TensorBoard event files (``tensorboard``'s own event
writer: no TensorFlow, no torch), an MLflow run (``MlflowClient``), a W&B offline run (``wandb.init``).

Each writer takes ``log(step, metrics)``, ``flush()`` and ``close()``; its library is imported when it is made,
on the tracking thread of rank 0's agent (:mod:`meridian.workers.tracking.sink`), never on the training path.
A job's run is found again by the job's id when rank 0 moves to another worker after a re-formation (the MLflow
run by its tag, the W&B run by its id; TensorBoard reads every event file of the folder).

Where the job's folder is a URL (an object store), TensorBoard and W&B write to a local folder that
:class:`Mirror` copies there on every flush: neither library appends to objects.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from typing import Any, Protocol

from meridian.workers.contracts.tracking import MlflowTracking, WandbTracking
from meridian.workers.state import storage

JOB_TAG = "meridian.job_id"


class Writer(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class Mirror:
    """A local folder copied to ``url`` (only files that changed since the last copy)."""

    def __init__(self, local: str, url: str) -> None:
        self.local, self.url = local, url
        self._sent: dict[str, tuple[int, int]] = {}

    def sync(self) -> None:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(self.url)
        for folder, _, files in os.walk(self.local):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if self._sent.get(path) == (st.st_size, st.st_mtime_ns):
                    continue
                rel = os.path.relpath(path, self.local).replace(os.sep, "/")
                fs.put_file(path, f"{root.rstrip('/')}/{rel}")
                self._sent[path] = (st.st_size, st.st_mtime_ns)

    def close(self) -> None:
        """The last copy, then the local folder goes."""
        try:
            self.sync()
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


def place(job_dir: str, job_id: str, name: str) -> tuple[str, Mirror | None]:
    """The local folder a tracker writes ``name`` to, and the mirror that copies it into the job's folder when
    that is a URL."""
    target = storage.join(job_dir, name)
    if not storage.is_url(job_dir):
        os.makedirs(target, exist_ok=True)
        return target, None
    local = tempfile.mkdtemp(prefix=f"meridian-tracking-{job_id}-{name}-")  # this writer's own, removed at close
    return local, Mirror(local, target)


class TensorBoardWriter:
    """Scalars per step, and the hyperparameters once (TensorBoard's HParams tab), in ``<folder>``."""

    def __init__(self, folder: str, hparams: dict[str, str], *, job_id: str, mirror: Mirror | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.hparams import summary_v2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self.mirror = Event, Summary, mirror
        # One file per writer process: rank 0 may move to another worker, whose file comes after this one.
        self._writer = EventFileWriter(folder, filename_suffix=f".{socket.gethostname()}.{os.getpid()}")
        self._writer.add_event(Event(wall_time=time.time(), summary=summary_v2.hparams_pb(hparams, trial_id=job_id)))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))

    def flush(self) -> None:
        self._writer.flush()
        if self.mirror is not None:
            self.mirror.sync()

    def close(self) -> None:
        self._writer.close()
        if self.mirror is not None:
            self.mirror.close()


class MlflowWriter:
    """The job's MLflow run (tagged with its id; made on first use, found again after), params set once."""

    def __init__(self, cfg: MlflowTracking, hparams: dict[str, str], *, job_id: str) -> None:
        if cfg.uri.startswith("file:"):
            # MLflow 3 keeps its file store only on request; the job asked for one (a file: URI).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=cfg.uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=job_id, tags={JOB_TAG: job_id}).info.run_id
            params = [Param(k[:250], v[:6000]) for k, v in hparams.items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[i: i + 100])
        self._pending: list[Any] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self._pending += [self._metric(k, v, now, step) for k, v in metrics.items()]

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=pending[i: i + 1000])

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)


class WandbWriter:
    """The job's W&B run, offline, in ``<folder>/wandb``; its id is the job's, so a second writer resumes it."""

    def __init__(self, cfg: WandbTracking, folder: str, hparams: dict[str, str], *, job_id: str,
                 mirror: Mirror | None = None) -> None:
        import wandb

        self.mirror = mirror
        self.run = wandb.init(mode="offline", project=cfg.project, id=job_id, name=job_id, dir=folder,
                              config=hparams, resume="allow", reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True,
                                                      save_code=False, disable_git=True))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def flush(self) -> None:
        if self.mirror is not None:
            self.mirror.sync()

    def close(self) -> None:
        self.run.finish()
        if self.mirror is not None:
            self.mirror.close()
