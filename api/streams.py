"""Long-lived responses: a job's events as Server-Sent Events, and its worker logs followed as JSON lines.

Both read the store (or the nodes) in short polls off the event loop, end by themselves when the job is
finished and everything was sent, stop when the client goes away, and send a keep-alive while quiet so
proxies do not cut an idle stream. Each open one polls the store a few times a second, so an owner may hold
only so many at once (:class:`StreamSlots`); one more is a 429 saying which to close.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from meridian.api.errors import TooManyStreams
from meridian.api.schemas import EventPublic
from meridian.service.store import JobStore
from meridian.workers.contracts.events import EventKind

POLL_S = 0.25
KEEPALIVE_S = 15.0
BATCH = 500
DRAIN_S = 30.0
"""After a job ends, how long a followed log may keep reading what its workers wrote last."""
DEFAULT_MAX_STREAMS_PER_OWNER = 32
"""Event streams and followed logs one owner may hold open at once (``meridian serve --max-streams-per-owner``):
a page per job, a few terminals. At stop 48, 100 idle streams made a plain job read 3.7 times slower (12 → 44 ms)."""


class StreamSlots:
    """How many long-lived responses each owner holds open, against a limit per owner."""

    def __init__(self, per_owner: int = DEFAULT_MAX_STREAMS_PER_OWNER) -> None:
        if per_owner < 1:
            raise ValueError(f"the streams an owner may hold open must be at least 1, got {per_owner}")
        self.per_owner = per_owner
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def open_count(self, owner: str) -> int:
        with self._lock:
            return self._open.get(owner, 0)

    def hold(self, owner: str, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """``stream``, counted as one of ``owner``'s until it ends, fails, its client goes away, or it is dropped
        unstarted (a client gone before the first byte); :class:`TooManyStreams` if ``owner`` holds the most."""
        with self._lock:
            held = self._open.get(owner, 0)
            if held >= self.per_owner:
                who = f"owner {owner!r}" if owner else "this service's user"
                raise TooManyStreams(
                    f"{who} already holds {held} event streams and followed logs open, the most this service "
                    f"allows at once (meridian serve --max-streams-per-owner, now {self.per_owner}); close one "
                    "(`meridian events -f`, `meridian logs -f`, or another client following a job) and try again, or "
                    "read without following (GET .../events?after=ID, .../logs)")  # fmt: skip
            self._open[owner] = held + 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                left = self._open[owner] - 1
                if left:
                    self._open[owner] = left
                else:
                    del self._open[owner]

        async def counted() -> AsyncIterator[str]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                release()
                await stream.aclose()  # type: ignore[attr-defined]

        wrapped = counted()
        weakref.finalize(wrapped, release)  # never iterated: the response was dropped before its body began
        return wrapped


# Line ends that JSON leaves raw in a string but that many line readers split on (Python's str.splitlines,
# httpx's iter_lines): escaped, a message holding one stays on its data line. The JSON means the same.
_UNICODE_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_message(event: EventPublic) -> str:
    """One SSE message: its ``id``, its kind as the ``event`` name (a kind not in the registry, stored by an older
    version, goes as a plain ``message``: a browser's EventSource listens by name, to the registry's names), the
    event as JSON in ``data``."""
    kind = event.kind if EventKind.known(event.kind) is not None else "message"
    return f"id: {event.id}\nevent: {kind}\ndata: {event.model_dump_json().translate(_UNICODE_LINE_ENDS)}\n\n"


async def job_event_stream(request: Request, store: JobStore, job_id: str, after: int) -> AsyncIterator[str]:
    """Every event with an id above ``after``, live, each exactly once; ends after the job's last event."""
    yield "retry: 2000\n\n"
    last, quiet_since = after, time.monotonic()
    while True:
        # Read the state before the events: once a terminal state is seen, every event the job will
        # ever have is already committed, so the read below drains it completely.
        job = await run_in_threadpool(store.get_job, job_id)
        events = await run_in_threadpool(store.list_events, job_id, after=last, limit=BATCH)
        for e in events:
            yield sse_message(EventPublic.from_event(e))
            last = e.id
        if events:
            quiet_since = time.monotonic()
            if len(events) == BATCH:
                continue
        if job.status.state.is_terminal:
            yield f"event: end\ndata: {json.dumps({'state': job.status.state.value, 'last_event_id': last})}\n\n"
            return
        if await request.is_disconnected() or request.app.state.stopping.is_set():
            return  # (the service stops: the client resumes after `last` once it is back)
        if time.monotonic() - quiet_since > KEEPALIVE_S:
            yield ": keep-alive\n\n"
            quiet_since = time.monotonic()
        await asyncio.sleep(POLL_S)


def _note(line: str) -> str:
    """A line of the service's own in a followed log (rank -1)."""
    return json.dumps({"rank": -1, "stream": "err", "line": line}) + "\n"


async def follow_logs(
    request: Request, store: JobStore, service: Any, job_id: str, tail_bytes: int, ranks: set[int] | None,
    poll_s: float = 1.0,
) -> AsyncIterator[str]:
    """Worker log lines as JSON lines until the job ends; then read on until a read brings nothing new (one read
    takes at most 256 KiB a file: a job that printed more in its last second lost the rest, and the stream ended
    as if complete), for at most ``DRAIN_S``."""
    offsets: dict[str, int] | None = None
    last_keepalive = time.monotonic()
    drain_until: float | None = None
    said: str | None = None  # the read error last said: said once, not on every poll while it lasts
    while True:
        job = await run_in_threadpool(store.get_job, job_id)
        try:
            before = dict(offsets or {})
            entries, offsets = await run_in_threadpool(
                service.read_logs, job.placement or [], offsets, tail_bytes=tail_bytes, ranks=ranks)
        except Exception as e:  # noqa: BLE001 - a node that cannot be read now is retried, and said so
            error = f"(meridian: could not read logs: {e})"
            if error != said:
                yield _note(error)
                said = error
            entries, before = [], None
        else:
            if said is not None:
                yield _note("(meridian: reading logs again)")
                said = None
        for e in entries:
            yield json.dumps({"rank": e.rank, "stream": e.stream, "line": e.line}) + "\n"
        if job.status.state.is_terminal:
            drain_until = drain_until or time.monotonic() + DRAIN_S
            if before is None or offsets == before or time.monotonic() > drain_until or await request.is_disconnected():
                return
            continue  # the job is over: drain what its workers wrote, without waiting between reads
        if await request.is_disconnected():
            return
        if request.app.state.stopping.is_set():
            yield _note("(meridian: the service is stopping; follow the logs again once it is back)")
            return
        if not entries and time.monotonic() - last_keepalive > KEEPALIVE_S:
            yield "\n"  # an empty line: JSON-lines readers skip it
            last_keepalive = time.monotonic()
        await asyncio.sleep(poll_s)
