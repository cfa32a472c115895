"""Asking a worker's agent whether its process is still there, and telling it to stop a stuck one.

Each worker's agent listens on a port for as long as its process lives
(:mod:`meridian.workers.elastic.liveness`). A refused connection means its process is gone (the kernel of a
live host answers for it at once), a connect that times out means its host does not answer: evidence faster
than Ray's node health check (13 s with a ``ray start`` cluster's defaults). :class:`Probes` keeps each worker's
last answer and its misses in a row for :func:`~meridian.service.runner.liveness.judge.judge`, which decides what
they mean; nothing here decides. :meth:`Probes.abort` carries the one order the coordinator gives an agent
directly: stop the training process of an epoch (:func:`send_abort`).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from meridian.service.runner.liveness.judge import Probe
from meridian.workers.elastic.liveness import abort_message


def probe(address: str, port: int, timeout_s: float = 1.0) -> Probe:
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return Probe.ALIVE
    except ConnectionRefusedError:
        return Probe.GONE
    except OSError:
        return Probe.UNREACHABLE


def send_abort(address: str, port: int, epoch: int, timeout_s: float = 2.0) -> bool:
    """Tell the agent listening at ``address:port`` to stop its training process if it still trains in
    ``epoch``; ``True`` once the agent has acted on it."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as conn:
            conn.sendall(abort_message(epoch))
            return conn.recv(16).startswith(b"ok")
    except OSError:
        return False


@dataclass
class Probes:
    """Each worker's last probe answer and misses in a row; ``probe_fn(address, port)`` and
    ``abort_fn(address, port, epoch)`` are injectable for tests."""

    probe_fn: Callable[[str, int], Probe] = probe
    abort_fn: Callable[[str, int, int], bool] = send_abort
    last: dict[str, Probe] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    aborted: set[tuple[str, int]] = field(default_factory=set)
    """``(worker_id, epoch)`` pairs told to stop: each is told once."""
    _probing: set[str] = field(default_factory=set)
    _claims: threading.Lock = field(default_factory=threading.Lock)

    def probe_each(self, suspects: Iterable[tuple[str, str, int]]) -> set[str]:
        """Probe each ``(worker_id, address, port)`` (a port of 0: the worker has none, it is never probed) and
        record the answers; the worker ids whose answer is news (another answer, or one more miss).

        One probe of a worker at a time: every rejoining survivor's thread probes the silent member at the same
        moment, and two of their probes timing out together on one slow second counted as "twice in a row", so a
        live member was taken for gone. A worker whose probe is in flight is skipped; its result counts once."""
        news: set[str] = set()
        for wid, address, port in suspects:
            with self._claims:
                if not port or wid in self._probing:
                    continue
                self._probing.add(wid)
            try:
                result = self.probe_fn(address, port)
            finally:
                with self._claims:
                    self._probing.discard(wid)
            with self._claims:
                if self.last.get(wid) is not result or result is Probe.UNREACHABLE:
                    news.add(wid)
                self.last[wid] = result
                self.misses[wid] = self.misses.get(wid, 0) + 1 if result is Probe.UNREACHABLE else 0
        return news

    def seen(self, worker_id: str) -> tuple[Probe | None, int]:
        """Its last answer (``None``: not probed since it last called) and its misses in a row."""
        with self._claims:
            return self.last.get(worker_id), self.misses.get(worker_id, 0)

    def revive(self, worker_id: str) -> None:
        """``worker_id`` called the coordinator: it is alive, whatever its port answered before (a member taken
        for gone on a slow network, back as a newcomer, must be waited for and probed in later epochs again)."""
        with self._claims:
            self.last.pop(worker_id, None)
            self.misses.pop(worker_id, None)

    def abort(self, stuck: Iterable[tuple[str, str, int]], epoch: int) -> set[str]:
        """Tell each ``(worker_id, address, port)`` not told before to leave ``epoch``; the worker ids whose
        agent acted on it."""
        with self._claims:  # the coordinator judges from every rejoin's thread: one of them tells each worker
            told = [(wid, address, port) for wid, address, port in stuck if port and (wid, epoch) not in self.aborted]
            self.aborted |= {(wid, epoch) for wid, _, _ in told}
        return {wid for wid, address, port in told if self.abort_fn(address, port, epoch)}
