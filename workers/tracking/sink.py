"""Rank 0's trackers, fed from the records its agent already relays to the job's runner.

:class:`TrackingSink` wraps the agent's sink: every step record goes on to the runner as before and into a
queue that one thread of the agent drains into the trackers (:mod:`meridian.workers.tracking.writers`). Only the
worker that is rank 0 gets records, so only it opens them (lazily, at its first record); after a re-formation
the new rank 0's agent opens its own, on the same runs. Nothing here runs on the training path: a slow or
failing tracker delays only its thread, and a failure is reported once as a ``tracking_failed`` event, the
training going on. Torch-free, like the agent.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.records import StepRecord
from meridian.workers.contracts.tracking import CLOSE_TIMEOUT_S
from meridian.workers.tracking.metrics import hyperparameters, step_metrics
from meridian.workers.tracking.writers import MlflowWriter, TensorBoardWriter, WandbWriter, Writer, place

FLUSH_EVERY_S = 5.0
"""The trackers' files are flushed (and mirrored to a URL storage) this often while records come."""

EventFn = Callable[[str, str, dict[str, Any]], None]


def open_writers(cfg: TrainConfig) -> list[tuple[str, Writer]]:
    """The writers ``cfg.tracking`` asks for, each made through its library."""
    tracking, job = cfg.tracking, cfg.job_id
    assert tracking is not None
    hparams = hyperparameters(cfg)
    writers: list[tuple[str, Writer]] = []
    if tracking.tensorboard:
        folder, mirror = place(cfg.job_dir, job, "tensorboard")
        writers.append(("tensorboard", TensorBoardWriter(folder, hparams, job_id=job, mirror=mirror)))
    if tracking.mlflow is not None:
        writers.append(("mlflow", MlflowWriter(tracking.mlflow, hparams, job_id=job)))
    if tracking.wandb is not None:
        folder, mirror = place(cfg.job_dir, job, "wandb")
        writers.append(("wandb", WandbWriter(tracking.wandb, folder, hparams, job_id=job, mirror=mirror)))
    return writers


class TrackingSink:
    """A progress sink that also logs rank 0's records to the job's trackers (``cfg.tracking``)."""

    def __init__(self, inner: Any, cfg: TrainConfig, *, on_event: EventFn,
                 open_fn: Callable[[TrainConfig], list[tuple[str, Writer]]] = open_writers) -> None:
        self.inner, self.cfg, self.on_event, self.open_fn = inner, cfg, on_event, open_fn
        self._queue: queue.Queue[StepRecord | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failed: set[str] = set()
        if hasattr(inner, "rank_steps"):
            self.rank_steps = inner.rank_steps  # the agent relays heartbeats in batches when its sink takes them

    def step(self, record: StepRecord) -> None:
        self.inner.step(record)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="meridian-tracking", daemon=True)
                self._thread.start()
        self._queue.put(record)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Log what is queued, then close the trackers (their files complete); only if this worker opened them."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout_s)
        if thread.is_alive():
            self.on_event("tracking_failed", f"the trackers did not close within {timeout_s:.0f} s; their last "
                          "records may be missing", {})

    def _fail(self, name: str, when: str, e: BaseException) -> None:
        if name not in self._failed:
            self._failed.add(name)
            self.on_event("tracking_failed", f"{name} failed {when} ({type(e).__name__}: {e}); the job trains on "
                          f"without it", {"tracker": name, "error": f"{type(e).__name__}: {e}"[:500]})

    def _run(self) -> None:
        writers: list[tuple[str, Writer]] = []
        try:
            writers = self.open_fn(self.cfg)
        except Exception as e:  # noqa: BLE001 - a tracker must never stop training
            self._fail("tracking", "to start", e)
        flushed = time.monotonic()
        while True:
            record = self._queue.get()
            if record is not None:
                metrics = step_metrics(record)
                for name, w in writers:
                    if name not in self._failed:
                        try:
                            w.log(record.step, metrics)
                        except Exception as e:  # noqa: BLE001
                            self._fail(name, f"at step {record.step}", e)
            if record is None or (time.monotonic() - flushed > FLUSH_EVERY_S and self._queue.empty()):
                for name, w in writers:
                    if name not in self._failed:
                        try:
                            w.close() if record is None else w.flush()
                        except Exception as e:  # noqa: BLE001
                            self._fail(name, "to write its files", e)
                flushed = time.monotonic()
            if record is None:
                return
