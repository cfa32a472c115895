from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).parent))  # for `import fakes`

from fakes import FakeLauncher, FakeService, topology  # noqa: E402

from meridian.service.store import JobStore  # noqa: E402
from meridian.service.supervision.supervisor import Supervisor  # noqa: E402


@pytest.fixture
def store(tmp_path):
    s = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    yield s
    s.close()


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL server for the whole run (skips, saying why, where none can be started)."""
    from postgres_server import PostgresServer, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"PostgreSQL: {reason}")
    with PostgresServer() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """The URL of a fresh, empty job database: SQLite (the default) and a real PostgreSQL, so a module that
    builds its stores from this fixture proves the store on both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return request.getfixturevalue("postgres_server").new_database()


class TopologyBox:
    """A mutable holder, so a test can change the cluster between ticks."""

    def __init__(self, topo):
        self.topo = topo

    def __call__(self):
        return self.topo


@pytest.fixture
def cluster_view():
    return TopologyBox(topology(dc_a=2, dc_b=2))


@pytest.fixture
def supervisor(store, cluster_view, tmp_path):
    return Supervisor(store, FakeLauncher(), cluster_view, checkpoint_root=str(tmp_path / "ckpt"))


@pytest.fixture
def service(store, supervisor, cluster_view):
    """The API's service over the real store and supervisor and the fake cluster."""
    return FakeService(store, supervisor, cluster_view)


# -- the end of the run ------------------------------------------------------------------------------------------
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's finalization once every result is reported and every plugin is done.

    This process has hosted Ray drivers (connected to clusters whose raylets the tests killed), gloo groups and
    torch's thread pools; tearing those down in the interpreter's finalization crashed once in CI with SIGSEGV
    after the summary was printed (1 failed, 473 passed, reported as a segfault). The run's status is the tests'.
    """
    if _EXIT_STATUS and os.environ.get("MERIDIAN_TEST_HARD_EXIT", "1") == "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
