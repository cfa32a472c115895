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


# -- Ray clusters kept between modules -------------------------------------------------------------------------
KEPT_CLUSTERS = ("four_nodes", "two_nodes")
"""The fixtures of :class:`ray_env.KeptCluster`: the tests that ask for one run one after the other, on one cluster."""


@pytest.fixture(scope="module")
def four_nodes():
    """A local Ray cluster of ``ray_env.FOUR_NODES``, shared with the next module that asks for it while idle."""
    from ray_env import FOUR_NODES, kept_cluster

    return kept_cluster.get(FOUR_NODES)


@pytest.fixture(scope="module")
def two_nodes():
    """A local Ray cluster of ``ray_env.TWO_NODES``, shared with the next module that asks for it while idle."""
    from ray_env import TWO_NODES, kept_cluster

    return kept_cluster.get(TWO_NODES)


def _kept(item) -> str | None:
    return next((name for name in KEPT_CLUSTERS if name in getattr(item, "fixturenames", ())), None)


def pytest_collection_modifyitems(items):
    """The tests that ask for the same kept cluster run together, where the first of them would (the rest keep
    their order), so that one start serves them all."""
    groups: dict[str, list] = {}
    for item in items:
        if (name := _kept(item)) is not None:
            groups.setdefault(name, []).append(item)
    ordered = []
    for item in items:
        name = _kept(item)
        if name is None:
            ordered.append(item)
        elif name in groups:
            ordered += groups.pop(name)
    items[:] = ordered


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test in a row that asks for a kept cluster (its module's fixtures torn down first), shut it
    down: the tests after it start their own clusters."""
    try:
        return (yield)
    finally:
        if _kept(item) is not None and (nextitem is None or _kept(nextitem) != _kept(item)):
            from ray_env import kept_cluster

            kept_cluster.close()


# -- the end of the run ------------------------------------------------------------------------------------------
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    if (ray_env := sys.modules.get("ray_env")) is not None:
        ray_env.kept_cluster.close()  # shut down already after its last test, unless the run was interrupted
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
