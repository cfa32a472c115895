"""One service per database: a lease row that the running service holds and renews.

Two services on one job store would both launch every queued job and store every record twice. The
service takes the lease at start-up (:meth:`Lease.acquire`) and refuses to start, naming the holder, while
another service holds it; the supervisor renews it every tick (:meth:`Lease.renew`) and stops acting on
jobs the moment it finds the lease taken over. A lease is free once it expires (``ttl_s`` after its last
renewal), at once when its holder stops cleanly (:meth:`Lease.release`), and at once when the holder ran
on this same host and its process is gone (a service killed with ``kill -9`` and restarted).

Every write is a compare-and-set in the database, so two services starting together cannot both win.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass

import sqlalchemy as sa

from meridian.service.errors import MeridianError
from meridian.service.store import metadata

lease_table = sa.Table(
    "service_lease", metadata,
    sa.Column("id", sa.Integer, primary_key=True),  # always 1: one row, one owner
    sa.Column("holder", sa.String(64), nullable=False),  # random id of the holding service instance
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("acquired_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)

DEFAULT_TTL_S = 30.0


class DatabaseOwned(MeridianError):
    """Another service holds this database's lease."""


class LeaseLost(MeridianError):
    """This service's lease was taken over: it must stop acting on jobs."""


@dataclass(frozen=True)
class Holder:
    holder: str
    host: str
    pid: int
    acquired_at: float
    expires_at: float


class Lease:
    def __init__(self, engine: sa.Engine, *, ttl_s: float = DEFAULT_TTL_S, clock=time.time) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self.clock = clock
        self.holder = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._renewed_at = -1e18
        lease_table.create(engine, checkfirst=True)

    def acquire(self) -> None:
        """Take the lease, or raise :class:`DatabaseOwned` naming who holds it and how to take over."""
        now = self.clock()
        values = {"holder": self.holder, "host": self.host, "pid": self.pid, "acquired_at": now,
                  "expires_at": now + self.ttl_s}
        current = self.current()
        if current is None:
            try:
                with self.engine.begin() as conn:
                    conn.execute(lease_table.insert().values(id=1, **values))
                self._renewed_at = now
                return
            except sa.exc.IntegrityError:
                current = self.current()  # another service inserted it first
        if current is not None and current.holder != self.holder and not self._free(current, now):
            raise DatabaseOwned(
                f"another Meridian service (pid {current.pid} on {current.host}) owns this database since "
                f"{time.strftime('%H:%M:%S', time.localtime(current.acquired_at))}; two services on one database "
                f"would launch every job twice. Stop that service, or, if it is gone, start this one again after "
                f"its lease expires at {time.strftime('%H:%M:%S', time.localtime(current.expires_at))} "
                f"(in {max(0.0, current.expires_at - now):.0f} s; leases last {self.ttl_s:.0f} s unless renewed)")
        with self.engine.begin() as conn:
            c = lease_table.c
            guard = c.id == 1
            if current is not None:  # compare-and-set on what was read
                guard = sa.and_(guard, c.holder == current.holder, c.expires_at == current.expires_at)
            if conn.execute(lease_table.update().where(guard).values(**values)).rowcount != 1:
                raise DatabaseOwned("another Meridian service took this database's lease at the same moment; "
                                    "stop one of them")
        self._renewed_at = now

    def renew(self, *, every_s: float | None = None) -> bool:
        """Extend the lease (at most every ``every_s``, default a third of the TTL); ``False`` if it was
        taken over, after which this service must stop acting on jobs."""
        now = self.clock()
        if now - self._renewed_at < (self.ttl_s / 3 if every_s is None else every_s):
            return True
        with self.engine.begin() as conn:
            c = lease_table.c
            ok = conn.execute(lease_table.update().where(c.id == 1, c.holder == self.holder)
                              .values(expires_at=now + self.ttl_s)).rowcount == 1
        if ok:
            self._renewed_at = now
        return ok

    def release(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(lease_table.delete().where(lease_table.c.id == 1, lease_table.c.holder == self.holder))

    def current(self) -> Holder | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(lease_table).where(lease_table.c.id == 1)).first()
        if row is None:
            return None
        m = row._mapping
        return Holder(m["holder"], m["host"], m["pid"], m["acquired_at"], m["expires_at"])

    def _free(self, current: Holder, now: float) -> bool:
        if current.expires_at < now:
            return True
        return current.host == self.host and not _alive(current.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
