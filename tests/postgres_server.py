"""A throwaway PostgreSQL server for the tests that prove the job store on a real database.

Debian's ``postgresql`` package puts ``initdb`` and ``pg_ctl`` under ``/usr/lib/postgresql/<version>/bin``.
The server listens only on a Unix socket in a temporary folder (no TCP port, nothing reachable from
outside) and is removed when the tests end. PostgreSQL refuses to run as root, so as root the server runs
as the ``postgres`` user the package creates. Where any of this is missing, :func:`unavailable` says why and
the tests skip with that reason.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from meridian.workers.distributed.ports import free_port

START_TIMEOUT_S = 60


def _bin_dir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


def _run_as() -> list[str]:
    """The prefix that runs a server command as a non-root user (PostgreSQL will not run as root)."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


def unavailable() -> str | None:
    """Why a PostgreSQL server cannot be started here, or None if it can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the PostgreSQL driver is not installed (pip install 'psycopg[binary]')"
    if _bin_dir() is None:
        return "PostgreSQL is not installed (Debian: apt-get install postgresql)"
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            return "running as root without runuser, so PostgreSQL cannot be started as another user"
        try:
            import pwd
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    return None


class PostgresServer:
    """``with PostgresServer() as pg: pg.new_database()`` gives a SQLAlchemy URL of a fresh, empty database."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="meridian-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "socket"
        self.port = free_port()  # names the socket file (.s.PGSQL.<port>); no TCP listener is opened
        self.bin = _bin_dir()
        self.user = "postgres" if os.geteuid() == 0 else os.environ.get("USER", "postgres")

    def _cmd(self, tool: str, *args: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
        proc = subprocess.run([*_run_as(), str(self.bin / tool), *args], capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({proc.returncode}): {proc.stderr or proc.stdout}")
        return proc

    def __enter__(self) -> PostgresServer:
        self.socket_dir.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.socket_dir, "postgres")
        self._cmd("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "--no-sync", "-E", "UTF8")
        options = f"-k {self.socket_dir} -p {self.port} -c listen_addresses='' -c fsync=off"
        self._cmd("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "server.log"),
                  "-w", "-t", str(START_TIMEOUT_S), "start")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._cmd("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{self.user}@/{database}?host={self.socket_dir}&port={self.port}"

    def new_database(self) -> str:
        import sqlalchemy as sa

        name = f"t_{uuid.uuid4().hex[:12]}"
        engine = sa.create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        return self.url(name)
