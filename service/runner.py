"""The job runner: a detached Ray actor that owns one job's TorchTrainer.

It runs ``TorchTrainer.fit()`` in a thread and buffers what the workers push (per-step records, events,
the final result) under increasing sequence numbers. The service polls it with a cursor, so a restarted
service picks up exactly where the stored cursor says — nothing dropped, nothing twice. Because the actor
is detached and named ``meridian-job-<id>``, training outlives the service process.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections import deque
from typing import Any

import ray

NAMESPACE = "meridian"
KEEP_RECORDS = 20_000


def runner_name(job_id: str) -> str:
    return f"meridian-job-{job_id}"


def _controller_hook(name: str, namespace: str) -> Any:
    """A Ray Train controller callback that hands the controller's handle to the runner (for cancel)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class _TellRunner(ControllerCallback):
        def after_controller_start(self, train_run_context: Any) -> None:
            me = ray.get_runtime_context().current_actor
            ray.get_actor(name, namespace=namespace).set_controller.remote(me)

    return _TellRunner()


def _describe_failure(error: BaseException) -> str:
    """The root cause of a Train failure in one readable paragraph (not a wall of Ray internals)."""
    text = str(error)
    for marker in ("RuntimeError: ", "ValueError: ", "MemoryError", "ActorDiedError"):
        if marker in text:
            tail = text[text.rindex(marker):]
            return tail.strip().splitlines()[0][:2000]
    return text.strip().splitlines()[-1][:2000] if text.strip() else type(error).__name__


class JobRunner:
    def __init__(self, job_id: str, train_config: dict[str, Any], plan: dict[str, Any], storage_path: str) -> None:
        self.job_id = job_id
        self.name = runner_name(job_id)
        self.train_config = train_config
        self.plan = plan
        self.storage_path = storage_path
        self._lock = threading.Lock()
        self._seq = 0
        self._records: deque[tuple[int, dict[str, Any]]] = deque(maxlen=KEEP_RECORDS)
        self._events: deque[tuple[int, dict[str, Any]]] = deque(maxlen=KEEP_RECORDS)
        self._state = "starting"  # starting → running → succeeded | failed | cancelled
        self._error = ""
        self._result: dict[str, Any] | None = None
        self._controller: Any = None
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    # -- called by the service ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"fit-{self.job_id}", daemon=True)
            self._thread.start()

    def poll(self, after: int) -> dict[str, Any]:
        """Everything pushed after cursor ``after``, plus the runner's state."""
        with self._lock:
            return {
                "state": self._state, "error": self._error, "result": self._result,
                "records": [(s, r) for s, r in self._records if s > after],
                "events": [(s, e) for s, e in self._events if s > after],
                "cursor": self._seq,
            }

    def cancel(self) -> None:
        self._cancel.set()
        controller = self._controller
        if controller is not None:
            # abort() ends the controller process, so the call itself always "fails": that is success.
            with contextlib.suppress(Exception):
                ray.get(controller.abort.remote(), timeout=30)

    # -- called by the workers and the Train controller -------------------------------------------------
    def set_controller(self, controller: Any) -> None:
        self._controller = controller
        if self._cancel.is_set():
            self.cancel()

    def push_progress(self, records: list[dict[str, Any]]) -> None:
        with self._lock:
            if self._state == "starting":
                self._state = "running"
            for r in records:
                self._seq += 1
                self._records.append((self._seq, r))

    def push_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, {"kind": kind, "message": message, "data": data or {}, "time": time.time()}))

    def push_result(self, result: dict[str, Any]) -> None:
        with self._lock:
            self._result = result

    # -- the fit thread ---------------------------------------------------------------------------------
    def _finish(self, state: str, error: str = "") -> None:
        with self._lock:
            self._state, self._error = state, error

    def _run(self) -> None:
        try:
            from ray.train import FailureConfig, RunConfig, ScalingConfig
            from ray.train.torch import TorchTrainer

            from meridian.workers.entry import ray_train_entry

            labels = [{"datacenter": dc} for dc in self.plan["rank_datacenters"]]
            resources = dict(self.plan["resources_per_worker"])
            trainer = TorchTrainer(
                ray_train_entry,
                train_loop_config={"config": self.train_config, "runner_name": self.name, "namespace": NAMESPACE},
                scaling_config=ScalingConfig(
                    num_workers=len(labels), use_gpu=self.plan["use_gpu"], label_selector=labels,
                    resources_per_worker=resources,
                ),
                run_config=RunConfig(
                    name=f"meridian-{self.job_id}", storage_path=self.storage_path,
                    failure_config=FailureConfig(max_failures=0),
                    callbacks=[_controller_hook(self.name, NAMESPACE)],
                ),
            )
            result = trainer.fit()
            if self._cancel.is_set():
                self._finish("cancelled")
            elif result.error is not None:
                self._finish("failed", _describe_failure(result.error))
            else:
                self._finish("succeeded")
        except BaseException as e:  # noqa: BLE001 - every outcome must reach the service
            if self._cancel.is_set():
                self._finish("cancelled")
            else:
                self._finish("failed", _describe_failure(e) or traceback.format_exc(limit=3))
