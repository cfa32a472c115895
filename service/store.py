"""The job store: every job, its events and its metric time series, in a real database.

SQLite file by default (``sqlite:///<data_dir>/meridian.db``); any SQLAlchemy URL works. Every state change
goes through :func:`meridian.service.jobs.transition` inside one transaction, so concurrent writers cannot
skip a state. A restart of the service loses nothing that was committed here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import StaticPool

from meridian.service.errors import IdempotencyConflict, InvalidTransition, JobNotFound
from meridian.service.jobs import JobRequest, JobState, JobStatus, transition
from meridian.service.quotas import Quota
from meridian.service.resolved import ResolvedJob
from meridian.workers.contracts.events import EventKind, JobEvent, StateChanged

CAS_ATTEMPTS = 20
"""How often :meth:`JobStore.set_status` re-reads a status that a concurrent writer changed under it."""

metadata = sa.MetaData()

jobs_table = sa.Table(
    "jobs", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),  # submission order, for FIFO
    sa.Column("id", sa.String(32), unique=True, nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("owner", sa.String(200), nullable=False, default=""),
    sa.Column("priority", sa.Integer, nullable=False, default=0),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("reason", sa.String(64), nullable=False, default=""),
    sa.Column("message", sa.Text, nullable=False, default=""),
    sa.Column("request", sa.Text, nullable=False),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("plan", sa.Text),
    sa.Column("resolved", sa.Text),  # the plan and training config fixed at submit (ResolvedJob.to_json)
    sa.Column("placement", sa.Text),
    sa.Column("progress", sa.Text),
    sa.Column("result", sa.Text),
    sa.Column("runner", sa.String(128)),
    # Control state, apart from ``reason`` (which is for people): a cancel was asked for and the runner
    # has not answered yet.
    sa.Column("cancel_requested", sa.Boolean, nullable=False, default=False, server_default=sa.false()),
    sa.Column("cancel_requested_at", sa.Float),  # when the cancel was asked for (its deadline counts from here)
    # A suspension (preemption) was asked for and the runner has not written its checkpoint yet.
    sa.Column("suspend_requested", sa.Boolean, nullable=False, default=False, server_default=sa.false()),
    sa.Column("suspend_requested_at", sa.Float),  # its deadline counts from here
    # Times the job went back to the queue because its runner actor was lost (bounded by the service's option).
    sa.Column("relaunches", sa.Integer, nullable=False, default=0, server_default="0"),
    sa.Column("state_since", sa.Float),  # when ``state`` last changed (the placing deadline counts from here)
    sa.Column("idempotency_key", sa.String(200)),
    sa.Column("request_hash", sa.String(64)),  # of the submitted body, so a reused key with another body is refused
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float),
    sa.Column("finished_at", sa.Float),
    sa.UniqueConstraint("owner", "idempotency_key", name="uq_owner_idempotency_key"),
)

events_table = sa.Table(
    "events", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False, index=True),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("kind", sa.String(64), nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("data", sa.Text, nullable=False),
)

# One row that every transaction writing events updates first and holds until it commits. Event ids come
# from an autoincrement counter, which a database hands out when a row is inserted, not when it commits: on
# PostgreSQL two writers can take ids 10 and 11 and commit 11 first, and an SSE reader that saw 11 and
# resumes "after 11" would never see 10. Holding this row's lock from id to commit makes ids commit in
# order on every database (SQLite already writes one transaction at a time).
event_order_table = sa.Table(
    "event_order", metadata,
    sa.Column("id", sa.Integer, primary_key=True),  # always 1
    sa.Column("transactions", sa.BigInteger, nullable=False, default=0),  # event-writing commits so far
)

quotas_table = sa.Table(
    "quotas", metadata,
    sa.Column("owner", sa.String(200), primary_key=True),
    sa.Column("cpus", sa.Float),  # NULL: no limit
    sa.Column("gpus", sa.Float),
    sa.Column("jobs", sa.Integer),
    sa.Column("updated_at", sa.Float, nullable=False),
)

metrics_table = sa.Table(
    "metrics", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False, index=True),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("data", sa.Text, nullable=False),
)


@dataclass(frozen=True)
class JobRecord:
    id: str
    seq: int
    name: str
    owner: str
    priority: int
    status: JobStatus
    request_json: str = field(repr=False)
    spec: dict[str, Any]
    plan: dict[str, Any] | None
    placement: list[dict[str, Any]] | None
    progress: dict[str, Any] | None
    result: dict[str, Any] | None
    runner: str | None
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    cancel_requested: bool = False
    """A cancel was asked for while the job ran; the supervisor finishes it once the runner stops."""
    cancel_requested_at: float | None = None
    state_since: float | None = None
    """When the job entered its current state (``created_at`` for a job stored before this was kept)."""
    request_hash: str | None = None
    resolved_json: str | None = field(default=None, repr=False)
    suspend_requested: bool = False
    """The job is being preempted: the supervisor asks its runner to checkpoint and stop until it has."""
    suspend_requested_at: float | None = None
    relaunches: int = 0
    """Times the job was queued again after its runner actor was lost (``meridian serve --max-relaunches``)."""
    placement_json: str | None = field(default=None, repr=False, compare=False)
    """:attr:`placement` as stored: the API validates a stored placement once per distinct text."""

    @cached_property
    def request(self) -> JobRequest:
        # Parsed on first use: listing jobs for the API never needs it, and it is the costliest column.
        return JobRequest.from_dict(json.loads(self.request_json))

    @cached_property
    def resolved(self) -> ResolvedJob | None:
        """The plan and training config fixed at submit; ``None`` for a job stored by a service older than them."""
        return _resolved(self.resolved_json) if self.resolved_json else None


@functools.lru_cache(maxsize=64)
def _resolved(text: str) -> ResolvedJob:
    """A stored resolved job, parsed once per distinct text: the supervisor reads every active job's at every tick
    (its plan lists every rank). Frozen, so shared between reads."""
    return ResolvedJob.from_json(text)


@dataclass(frozen=True)
class Event:
    """A stored event as read back: its kind as stored (a kind of an older version may not be in
    :class:`~meridian.workers.contracts.events.EventKind`) and its payload's JSON form."""

    id: int
    job_id: str
    time: float
    kind: str
    message: str
    data: dict[str, Any]


def request_hash(spec: dict[str, Any]) -> str:
    """A stable hash of a submitted body (its JSON form), stored with an idempotency key."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def new_job_id() -> str:
    """A fresh job id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def _event_row(job_id: str, event: JobEvent) -> dict[str, Any]:
    """The events table's row of a typed event: strings and JSON from here on."""
    return dict(job_id=job_id, time=event.time, kind=event.kind.value, message=event.message,
                data=json.dumps(event.data))


def _loads(text: str | None) -> Any:
    return json.loads(text) if text else None


@functools.lru_cache(maxsize=64)
def _decoded_placement(text: str) -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(text))


def _placement(text: str | None) -> list[dict[str, Any]] | None:
    """A stored placement, decoded once per distinct text (one entry per rank, read at every GET and poll: a job of
    3,072 ranks decoded 3,072 entries each time); the entries are shared between reads, which never change them."""
    return list(_decoded_placement(text)) if text else None


def _record(row: sa.Row) -> JobRecord:
    m = row._mapping
    return JobRecord(
        id=m["id"], seq=m["seq"], name=m["name"], owner=m["owner"], priority=m["priority"],
        status=JobStatus(JobState(m["state"]), m["reason"], m["message"]),
        request_json=m["request"], spec=json.loads(m["spec"]),
        plan=_loads(m["plan"]), placement=_placement(m["placement"]), progress=_loads(m["progress"]),
        result=_loads(m["result"]), runner=m["runner"],
        created_at=m["created_at"], updated_at=m["updated_at"],
        started_at=m["started_at"], finished_at=m["finished_at"], cancel_requested=bool(m["cancel_requested"]),
        cancel_requested_at=m["cancel_requested_at"], state_since=m["state_since"] or m["created_at"],
        request_hash=m["request_hash"], resolved_json=m["resolved"], suspend_requested=bool(m["suspend_requested"]),
        suspend_requested_at=m["suspend_requested_at"], relaunches=m["relaunches"] or 0,
        placement_json=m["placement"],
    )


class JobStore:
    def __init__(self, url: str) -> None:
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            if url in ("sqlite://", "sqlite:///:memory:"):
                kwargs["poolclass"] = StaticPool
        self.engine = sa.create_engine(url, **kwargs)
        self._version_lock = threading.Lock()
        self._jobs_version = 0
        if url.startswith("sqlite"):
            @sa.event.listens_for(self.engine, "connect")
            def _pragmas(conn: Any, _record: Any) -> None:
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
                # In WAL mode NORMAL is still durable across a crash or kill of the service (only an OS
                # crash or power loss can drop the last commits) and saves an fsync per transaction.
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()
        metadata.create_all(self.engine)
        self._add_missing_columns()
        self._ensure_event_order_row()

    def _add_missing_columns(self) -> None:
        """Columns added after a database was created (``create_all`` makes missing tables, not columns)."""
        have = {c["name"] for c in sa.inspect(self.engine).get_columns("jobs")}
        added = {"cancel_requested": "BOOLEAN NOT NULL DEFAULT FALSE", "cancel_requested_at": "FLOAT",
                 "state_since": "FLOAT", "request_hash": "VARCHAR(64)", "resolved": "TEXT",
                 "suspend_requested": "BOOLEAN NOT NULL DEFAULT FALSE", "suspend_requested_at": "FLOAT",
                 "relaunches": "INTEGER NOT NULL DEFAULT 0"}
        for name, ddl in added.items():
            if name not in have:
                with self.engine.begin() as conn:
                    conn.execute(sa.text(f"ALTER TABLE jobs ADD COLUMN {name} {ddl}"))
        # A cancel asked for before its time was kept would wait for the runner forever (its deadline
        # counts from that time): count it from now, when this service first sees it.
        c = jobs_table.c
        with self.engine.begin() as conn:
            conn.execute(jobs_table.update().where(c.cancel_requested == sa.true(), c.cancel_requested_at.is_(None))
                         .values(cancel_requested_at=time.time()))

    def _ensure_event_order_row(self) -> None:
        with self.engine.connect() as conn:
            if conn.execute(sa.select(event_order_table.c.id)).first() is not None:
                return
        try:
            with self.engine.begin() as conn:
                conn.execute(event_order_table.insert().values(id=1, transactions=0))
        except sa.exc.IntegrityError:
            pass  # another store on this database inserted it first

    @staticmethod
    def _insert_events(conn: sa.Connection, rows: list[dict[str, Any]]) -> list[int]:
        """Insert event rows after taking the event-order lock (see ``event_order_table``), which the
        transaction holds until it commits. Call it after the transaction's other row writes, so every
        writer takes row locks first and this one last (no two writers can wait on each other)."""
        if not rows:
            return []
        conn.execute(event_order_table.update().where(event_order_table.c.id == 1)
                     .values(transactions=event_order_table.c.transactions + 1))
        return [int(conn.execute(events_table.insert().values(**row)).inserted_primary_key[0]) for row in rows]

    # -- jobs -------------------------------------------------------------------------------------------
    @property
    def jobs_version(self) -> int:
        """Grows after every committed change to a job record made through this store (the service is the
        database's only writer): a reader that saw version ``v`` before reading jobs may cache what it read
        until the version moves on."""
        return self._jobs_version

    def _jobs_changed(self) -> None:
        with self._version_lock:
            self._jobs_version += 1

    def create_job(
        self, request: JobRequest, spec: dict[str, Any], *, status: JobStatus, idempotency_key: str | None = None,
        request_hash: str | None = None, resolved: ResolvedJob | None = None, job_id: str | None = None,
    ) -> tuple[JobRecord, bool]:
        """Insert a job; returns (record, created). With an idempotency key already used by this owner,
        returns the existing job and ``created=False`` instead of a duplicate, or raises
        :class:`IdempotencyConflict` when the stored job was submitted with another body (``request_hash``).
        ``resolved``: the plan and training config fixed at submit, in the same insert (the scheduler may admit
        the job as soon as it is committed); ``job_id``: the id they were built for (default: a new one)."""
        if idempotency_key:
            existing = self.find_by_idempotency_key(request.owner, idempotency_key, request_hash)
            if existing is not None:
                return existing, False
        try:
            return self._insert_job(request, spec, status, idempotency_key, request_hash, resolved, job_id), True
        except sa.exc.IntegrityError:
            # A concurrent request with the same key won the race: answer with its job.
            existing = self.find_by_idempotency_key(request.owner, idempotency_key or "", request_hash)
            if existing is None:
                raise
            return existing, False

    def find_by_idempotency_key(self, owner: str, key: str, request_hash: str | None = None) -> JobRecord | None:
        """The job this owner submitted with ``key``, if any; raises :class:`IdempotencyConflict` if it was
        submitted with a body whose hash is not ``request_hash``."""
        existing = self._by_idempotency_key(owner, key)
        if existing is not None and request_hash and existing.request_hash and existing.request_hash != request_hash:
            raise IdempotencyConflict(
                f"Idempotency-Key {key!r} was already used for job {existing.id} with a different request body; "
                "resend the same body to get that job, or use a new key for a new job")
        return existing

    def _by_idempotency_key(self, owner: str, key: str) -> JobRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(jobs_table).where(jobs_table.c.owner == owner, jobs_table.c.idempotency_key == key)
            ).first()
        return _record(row) if row is not None else None

    def _insert_job(
        self, request: JobRequest, spec: dict[str, Any], status: JobStatus, idempotency_key: str | None,
        request_hash: str | None, resolved: ResolvedJob | None, job_id: str | None,
    ) -> JobRecord:
        now = time.time()
        job_id = job_id or new_job_id()
        with self.engine.begin() as conn:
            conn.execute(jobs_table.insert().values(
                id=job_id, name=request.name, owner=request.owner, priority=request.priority,
                state=status.state.value, reason=status.reason, message=status.message,
                request=json.dumps(request.to_dict()), spec=json.dumps(spec), idempotency_key=idempotency_key,
                request_hash=request_hash, created_at=now, updated_at=now, state_since=now,
                plan=json.dumps(resolved.plan.to_dict()) if resolved is not None else None,
                resolved=resolved.to_json() if resolved is not None else None,
            ))
            self._insert_events(conn, [_event_row(job_id, JobEvent(
                kind=EventKind.STATE, message=f"job submitted: {status.state.value}", time=now,
                payload=StateChanged(state=status.state.value, reason=status.reason, message=status.message)))])
            row = conn.execute(sa.select(jobs_table).where(jobs_table.c.id == job_id)).one()
        self._jobs_changed()
        return _record(row)

    def get_job(self, job_id: str) -> JobRecord:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs_table).where(jobs_table.c.id == job_id)).first()
        if row is None:
            raise JobNotFound(job_id)
        return _record(row)

    def list_jobs(
        self, *, states: set[JobState] | None = None, owner: str | None = None, limit: int = 100, offset: int = 0,
    ) -> list[JobRecord]:
        """Newest first."""
        q = sa.select(jobs_table).order_by(jobs_table.c.seq.desc()).limit(limit).offset(offset)
        if states:
            q = q.where(jobs_table.c.state.in_([s.value for s in states]))
        if owner is not None:
            q = q.where(jobs_table.c.owner == owner)
        with self.engine.connect() as conn:
            return [_record(r) for r in conn.execute(q)]

    def count_by_state(self) -> dict[JobState, int]:
        """How many jobs are in each state (every state present, zeros included), for the service metrics."""
        q = sa.select(jobs_table.c.state, sa.func.count()).group_by(jobs_table.c.state)
        counts = dict.fromkeys(JobState, 0)
        with self.engine.connect() as conn:
            for state, n in conn.execute(q):
                counts[JobState(state)] = int(n)
        return counts

    def queued_in_order(self) -> list[JobRecord]:
        """Queued jobs in admission order: higher priority first, then first submitted first."""
        q = (
            sa.select(jobs_table).where(jobs_table.c.state == JobState.QUEUED.value)
            .order_by(jobs_table.c.priority.desc(), jobs_table.c.seq.asc())
        )
        with self.engine.connect() as conn:
            return [_record(r) for r in conn.execute(q)]

    def set_status(
        self, job_id: str, status: JobStatus, *, expect: set[JobState] | None = None,
        cancel_requested: bool | None = None, unless_cancel_requested: bool = False,
        suspend_requested: bool | None = None,
    ) -> JobRecord:
        """Move a job to ``status`` (validated by :func:`transition`) and record the change as an event;
        ``cancel_requested=True`` marks a cancel request in the same transaction, ``suspend_requested`` a
        preemption's.

        Compare-and-set in the database: the row is updated only where it still holds the status that was
        read (``UPDATE … WHERE state = … AND reason = …``), so a writer that read a stale status re-reads and
        re-validates instead of overwriting a concurrent change (e.g. turning a ``cancelled`` job back into
        ``running``). ``expect``: the states the caller acts on; any other raises :class:`InvalidTransition`,
        as does a cancel-requested job with ``unless_cancel_requested``.
        """
        for _ in range(CAS_ATTEMPTS):
            now = time.time()
            with self.engine.begin() as conn:
                row = conn.execute(sa.select(jobs_table).where(jobs_table.c.id == job_id)).first()
                if row is None:
                    raise JobNotFound(job_id)
                m = row._mapping
                current = _record(row).status
                if expect is not None and current.state not in expect:
                    raise InvalidTransition(
                        f"job {job_id} is {current.state.value}, not {'/'.join(sorted(s.value for s in expect))}")
                if unless_cancel_requested and m["cancel_requested"]:
                    raise InvalidTransition(f"job {job_id} is being cancelled")
                new = transition(current, status)
                values: dict[str, Any] = {
                    "state": new.state.value, "reason": new.reason, "message": new.message, "updated_at": now,
                }
                if new.state is not current.state:
                    values["state_since"] = now
                if new.state is JobState.RUNNING and m["started_at"] is None:
                    values["started_at"] = now
                if new.state.is_terminal:
                    values["finished_at"] = now
                if suspend_requested is not None:
                    values["suspend_requested"] = suspend_requested
                    values["suspend_requested_at"] = now if suspend_requested else None
                if cancel_requested is not None:
                    values["cancel_requested"] = cancel_requested
                    if cancel_requested and not m["cancel_requested"]:
                        values["cancel_requested_at"] = now
                c = jobs_table.c
                guard = sa.and_(c.id == job_id, c.state == m["state"], c.reason == m["reason"],
                                c.message == m["message"], c.cancel_requested == m["cancel_requested"],
                                c.suspend_requested == m["suspend_requested"])
                if conn.execute(jobs_table.update().where(guard).values(**values)).rowcount != 1:
                    continue  # another writer changed the status since we read it: read again
                if (new.state, new.reason, new.message) != (current.state, current.reason, current.message):
                    self._insert_events(conn, [_event_row(job_id, JobEvent(
                        kind=EventKind.STATE, time=now,
                        message=f"{new.state.value}" + (f": {new.message}" if new.message else ""),
                        payload=StateChanged(state=new.state.value, reason=new.reason, message=new.message,
                                             previous=current.state.value)))])
                row = conn.execute(sa.select(jobs_table).where(jobs_table.c.id == job_id)).one()
            self._jobs_changed()
            return _record(row)
        raise InvalidTransition(f"job {job_id} kept changing while being set to {status.state.value}; try again")

    def update_fields(self, job_id: str, **fields: Any) -> None:
        """Set JSON fields (plan, placement, progress, result), plain ones (runner, relaunches) and ``resolved``."""
        values = self._field_values(fields, time.time())
        with self.engine.begin() as conn:
            if conn.execute(jobs_table.update().where(jobs_table.c.id == job_id).values(**values)).rowcount == 0:
                raise JobNotFound(job_id)
        self._jobs_changed()

    def record_poll(
        self, job_id: str, *, records: list[dict[str, Any]], events: list[JobEvent], **fields: Any,
    ) -> None:
        """Store one poll of a runner — its metric records, its events and the job fields (``progress``
        with the runner cursor) — in one transaction. A service killed mid-poll therefore either stored
        the batch and moved the cursor, or neither: after a restart nothing is dropped or stored twice."""
        now = time.time()
        values = self._field_values(fields, now)
        with self.engine.begin() as conn:
            if conn.execute(jobs_table.update().where(jobs_table.c.id == job_id).values(**values)).rowcount == 0:
                raise JobNotFound(job_id)
            if records:
                conn.execute(metrics_table.insert(), [
                    {"job_id": job_id, "step": int(r["step"]), "time": float(r.get("time", now)), "data": json.dumps(r)}
                    for r in records
                ])
            self._insert_events(conn, [_event_row(job_id, ev) for ev in events])
        self._jobs_changed()

    @staticmethod
    def _field_values(fields: dict[str, Any], now: float) -> dict[str, Any]:
        values: dict[str, Any] = {"updated_at": now}
        for key, value in fields.items():
            if key in ("plan", "placement", "progress", "result"):
                values[key] = json.dumps(value) if value is not None else None
            elif key in ("runner", "relaunches"):
                values[key] = value
            elif key == "resolved":
                values[key] = value.to_json() if value is not None else None
            else:
                raise KeyError(f"unknown job field {key!r}")
        return values

    # -- events -----------------------------------------------------------------------------------------
    def add_event(self, job_id: str, event: JobEvent) -> int:
        with self.engine.begin() as conn:
            return self._insert_events(conn, [_event_row(job_id, event)])[0]

    def list_events(self, job_id: str, *, after: int = 0, limit: int = 1000, newest: bool = False) -> list[Event]:
        """The job's events with an id above ``after``, oldest first: the first ``limit`` of them, or with
        ``newest`` the last ``limit`` (a long job's tail without reading its whole history)."""
        q = sa.select(events_table).where(events_table.c.job_id == job_id, events_table.c.id > after)
        q = q.order_by(events_table.c.id.desc() if newest else events_table.c.id).limit(limit)
        with self.engine.connect() as conn:
            events = [Event(r.id, r.job_id, r.time, r.kind, r.message, json.loads(r.data)) for r in conn.execute(q)]
        return events[::-1] if newest else events

    def count_events(self, job_id: str, *, after: int = 0, before: int | None = None) -> int:
        """How many of the job's events have an id above ``after`` (and below ``before``)."""
        q = sa.select(sa.func.count()).select_from(events_table).where(
            events_table.c.job_id == job_id, events_table.c.id > after)
        if before is not None:
            q = q.where(events_table.c.id < before)
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar_one())

    # -- quotas -----------------------------------------------------------------------------------------
    def set_quota(self, quota: Quota) -> Quota:
        """Store ``quota`` for its owner (replacing the one before); admission uses it from its next tick."""
        row = {"owner": quota.owner, "cpus": quota.cpus, "gpus": quota.gpus, "jobs": quota.jobs, "updated_at": time.time()}
        with self.engine.begin() as conn:
            if conn.execute(quotas_table.update().where(quotas_table.c.owner == quota.owner).values(**row)).rowcount == 0:
                conn.execute(quotas_table.insert().values(**row))
        self._jobs_changed()
        return quota

    def quotas(self) -> dict[str, Quota]:
        """Every owner's quota, by owner (an owner without one has no limit)."""
        with self.engine.connect() as conn:
            return {r.owner: Quota(owner=r.owner, cpus=r.cpus, gpus=r.gpus, jobs=r.jobs)
                    for r in conn.execute(sa.select(quotas_table))}

    # -- metrics ----------------------------------------------------------------------------------------
    def add_metrics(self, job_id: str, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        with self.engine.begin() as conn:
            conn.execute(metrics_table.insert(), [
                {"job_id": job_id, "step": int(r["step"]), "time": float(r.get("time", time.time())),
                 "data": json.dumps(r)}
                for r in records
            ])

    def list_metrics(self, job_id: str, *, after_step: int = 0, limit: int = 10_000) -> list[dict[str, Any]]:
        return [point for point, _ in self.page_metrics(job_id, after_step=after_step, limit=limit)]

    def page_metrics(self, job_id: str, *, after_step: int = 0, after_id: int | None = None,
                     limit: int = 10_000) -> list[tuple[dict[str, Any], int]]:
        """(point, row id) in (step, row id) order: after ``after_step`` or, with ``after_id``, after the row
        (``after_step``, ``after_id``). A step can be stored twice (a failure with snapshots every k > 1 steps
        trains up to k - 1 steps again), so a page that ends inside a step continues with that step's next row;
        by step alone, that row was skipped."""
        c = metrics_table.c
        after = c.step > after_step
        if after_id is not None:
            after = sa.or_(after, sa.and_(c.step == after_step, c.id > after_id))
        q = sa.select(c.data, c.id).where(c.job_id == job_id, after).order_by(c.step, c.id).limit(limit)
        with self.engine.connect() as conn:
            return [(json.loads(r.data), r.id) for r in conn.execute(q)]

    def close(self) -> None:
        self.engine.dispose()
