"""One service per database (issue 19): a second service on the same store refuses to start, naming the
owner and how to take over; a lease taken over stops the old service's supervisor from acting."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fakes import FakeLauncher

from meridian.service.jobs import JobRequest
from meridian.service.store import JobStore
from meridian.service.supervision.supervisor import Supervisor
from meridian.workers.contracts.model_config import model_preset


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


@pytest.fixture
def two_stores(database_url):
    a, b = JobStore(database_url), JobStore(database_url)
    yield a, b
    a.close()
    b.close()


def test_a_second_service_on_one_database_is_refused_until_the_lease_expires(two_stores):
    from meridian.service.lease import DatabaseOwned, Lease

    clock = Clock()
    first, second = (Lease(s.engine, ttl_s=30, clock=clock) for s in two_stores)
    first.acquire()
    with pytest.raises(DatabaseOwned, match=r"another Meridian service \(pid \d+ on .*\) owns this database.*"
                                            r"lease expires at .* \(in 30 s"):
        second.acquire()
    clock.t += 20
    assert first.renew()  # renewed at 20 s: it now lasts until 50 s
    clock.t += 25
    with pytest.raises(DatabaseOwned):
        second.acquire()
    clock.t += 6  # the first service stopped renewing (it hangs, or its host is gone): the lease expires
    second.acquire()
    assert not first.renew()  # and the old owner learns it lost the lease


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(two_stores):
    from meridian.service.lease import Lease, lease_table

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    first, second = (Lease(s.engine) for s in two_stores)
    first.acquire()
    with first.engine.begin() as conn:  # as if the service had been killed with kill -9
        conn.execute(lease_table.update().values(pid=int(dead.stdout)))
    second.acquire()
    assert second.current().holder == second.holder


def test_a_supervisor_whose_lease_was_taken_over_launches_nothing(two_stores, cluster_view, tmp_path):
    from meridian.service.lease import Lease, LeaseLost

    clock = Clock()
    a, b = two_stores
    mine = Lease(a.engine, ttl_s=30, clock=clock)
    mine.acquire()
    sup = Supervisor(a, FakeLauncher(), cluster_view, checkpoint_root=str(tmp_path), lease=mine)
    sup.submit(JobRequest(name="j", model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2), {})
    clock.t += 31
    Lease(b.engine, ttl_s=30, clock=clock).acquire()  # another service took over after an expiry
    with pytest.raises(LeaseLost, match="another service took over"):
        sup.tick()
    assert sup.launcher.launched == []


def test_meridian_serve_on_a_database_another_service_owns_exits_with_the_owner_named(tmp_path, capsys):
    from meridian.api.cli import main as cli_main
    from meridian.service.lease import Lease

    other = JobStore(f"sqlite:///{tmp_path / 'meridian.db'}")
    Lease(other.engine).acquire()  # a live service (this process) holds it
    try:
        code = cli_main(["serve", "--data-dir", str(tmp_path), "--port", "1", "--local-datacenters", "dc-a:1"])
    finally:
        other.close()
    err = capsys.readouterr().err
    assert code == 2 and "another Meridian service (pid" in err and "owns this database" in err
