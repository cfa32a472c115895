"""A ``torch.profiler`` trace of the next N steps of one rank, on request (``POST /v1/jobs/{id}/profile``).

The request reaches the training process without touching the step: the job's runner tells the worker's agent
once over its liveness port (:mod:`meridian.workers.elastic.liveness`), the agent leaves it in the worker's
folder (:mod:`meridian.workers.elastic.profile_request`), and a thread of this process looks for it four times a
second. The profiler starts and stops at step boundaries, on the training thread, driven by the heartbeat every
rank already gives after each step (:func:`~meridian.workers.loop.observe.heartbeat`): started after step ``k``,
it records steps ``k + 1 .. k + N`` (data, forward, backward, sync, update), each inside a ``step <n>`` span. The
Chrome trace (viewable in Perfetto or TensorBoard) is written on a thread of its own to
``<job folder>/profiles/<id>/rank-<r>.json``, and a ``profile_captured`` event says where.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

from meridian.workers.elastic.profile_request import take_request
from meridian.workers.state import storage

POLL_S = 0.25

EventFn = Callable[[str, str, dict[str, Any]], None]


def trace_location(job_dir: str, request_id: str, rank: int) -> str:
    return storage.join(job_dir, "profiles", request_id, f"rank-{rank}.json")


class StepProfiler:
    """Watches ``request_dir`` for a request; :meth:`beat` (every heartbeat of this rank) drives the capture."""

    def __init__(self, request_dir: str, job_dir: str, on_event: EventFn, *, poll_s: float = POLL_S) -> None:
        self.request_dir, self.job_dir, self.on_event = request_dir, job_dir, on_event
        self._pending: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._prof: Any = None
        self._span: Any = None
        self._request: tuple[str, int] = ("", 0)
        self._left = 0
        self._first_step = 0
        self._last = (0, 0)
        """(rank, steps done) of the last step boundary."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="meridian-profile-watch", daemon=True)
        self._thread.start()

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            with contextlib.suppress(OSError):
                request = take_request(self.request_dir)
                if request is not None:
                    with self._lock:
                        self._pending = request

    def close(self) -> None:
        """Stop watching; a capture still recording (the job ended first) is kept with the steps it has (on the
        training thread, after its last step)."""
        self._stop.set()
        if self._prof is not None:
            self._span.__exit__(None, None, None)
            self._finish(*self._last, wait=True)

    def beat(self, beat: dict[str, Any]) -> None:
        """A heartbeat of this rank; a ``done`` one is a step boundary (``step``: steps done)."""
        if beat.get("phase") != "done":
            return
        step, rank = int(beat["step"]), int(beat["rank"])
        self._last = (rank, step)
        if self._prof is not None:
            self._span.__exit__(None, None, None)
            self._left -= 1
            if self._left > 0:
                self._enter_span(step + 1)
                return
            self._finish(rank, step)
            return
        with self._lock:
            request, self._pending = self._pending, None
        if request is None:
            return
        if not self.job_dir:
            self.on_event("profile_failed", f"rank {rank} cannot keep profile {request[0]}: the job has no folder in "
                          "the service's storage", {"id": request[0], "rank": rank})
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.start()
        self._request, self._left, self._first_step = request, request[1], step + 1
        self._enter_span(step + 1)
        self.on_event("profile_started", f"rank {rank} records profile {request[0]}: steps {step + 1}-"
                      f"{step + request[1]}", {"id": request[0], "rank": rank, "from_step": step + 1,
                                               "steps": request[1]})

    def _enter_span(self, step: int) -> None:
        self._span = torch.autograd.profiler.record_function(f"step {step}")
        self._span.__enter__()

    def _finish(self, rank: int, last_step: int, *, wait: bool = False) -> None:
        prof, self._prof, self._span = self._prof, None, None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the steps' kernels are in the trace
        prof.stop()
        request_id, _ = self._request
        export = threading.Thread(target=self._export, args=(prof, request_id, rank, self._first_step, last_step),
                                  name="meridian-profile-export", daemon=True)
        export.start()
        if wait:
            export.join(60)

    def _export(self, prof: Any, request_id: str, rank: int, first: int, last: int) -> None:
        where = trace_location(self.job_dir, request_id, rank)
        try:
            with tempfile.TemporaryDirectory(prefix="meridian-profile-") as tmp:
                local = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(local)
                size = os.path.getsize(local)
                if storage.is_url(where):
                    with open(local, "rb") as src, storage.open_file(where, "wb") as dst:
                        while chunk := src.read(8 << 20):
                            dst.write(chunk)
                else:
                    os.makedirs(os.path.dirname(where), exist_ok=True)
                    partial = where + ".partial"
                    with open(local, "rb") as src, storage.open_file(partial, "wb") as dst:
                        while chunk := src.read(8 << 20):
                            dst.write(chunk)
                    os.replace(partial, where)  # a listing shows the trace whole or not at all
        except Exception as e:  # noqa: BLE001 - a trace must never stop training
            self.on_event("profile_failed", f"rank {rank} could not write profile {request_id} to {where} "
                          f"({type(e).__name__}: {e})", {"id": request_id, "rank": rank})
            return
        self.on_event("profile_captured", f"rank {rank} wrote profile {request_id} of steps {first}-{last} "
                      f"({size / 1e6:.1f} MB) to {where}", {"id": request_id, "rank": rank, "from_step": first,
                                                             "to_step": last, "path": where, "bytes": size})
