"""One service per database (issue 19): a second service on the same store refuses to start, naming the
owner and how to take over; a lease taken over stops the old service's supervisor from acting."""

from __future__ import annotations

import json
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
    from meridian.cli.main import main as cli_main
    from meridian.service.lease import Lease

    other = JobStore(f"sqlite:///{tmp_path / 'meridian.db'}")
    Lease(other.engine).acquire()  # a live service (this process) holds it
    argv = ["serve", "--data-dir", str(tmp_path), "--port", "1", "--local-datacenters", "dc-a:1"]
    try:
        code = cli_main(argv)
        err = capsys.readouterr().err
        assert code == 2 and "another Meridian service (pid" in err and "owns this database" in err
        code = cli_main([*argv, "--json"])
    finally:
        other.close()
    problem = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and problem["type"] == "urn:meridian:problem:serve-refused" and "owns this database" in problem["detail"]


def test_a_lease_taken_over_during_a_tick_stops_the_writes_after_the_slow_ray_call(two_stores, cluster_view, tmp_path):
    """A tick can outlast the lease (a poll waits up to 10 s, a launch up to 60 s): the lease is asked again before
    what a Ray call returned is stored, or the records the new owner already stored were stored twice."""
    from fakes import step_record

    from meridian.service.lease import Lease, LeaseLost

    clock = Clock()
    a, b = two_stores
    cluster = FakeLauncher()  # the one Ray cluster both services see
    mine = Lease(a.engine, ttl_s=30, clock=clock)
    mine.acquire()
    sup_a = Supervisor(a, cluster, cluster_view, checkpoint_root=str(tmp_path), lease=mine)
    job, _ = sup_a.submit(JobRequest(name="j", model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2), {})
    sup_a.tick()
    cluster.runners[job.id].state = "running"
    cluster.runners[job.id].push("record", step_record(1, 3, 5.0))
    sup_a.tick()
    cluster.runners[job.id].push("record", step_record(2, 3, 4.0))
    poll = cluster.poll

    def slow_poll(job_id, after):  # A's poll hangs past its lease; service B starts and follows the job meanwhile
        cluster.poll = poll  # B's polls answer at once
        clock.t += 35
        other = Lease(b.engine, ttl_s=30, clock=clock)
        other.acquire()
        Supervisor(b, cluster, cluster_view, checkpoint_root=str(tmp_path), lease=other).tick()
        return poll(job_id, after)

    cluster.poll = slow_poll
    with pytest.raises(LeaseLost):
        sup_a.tick()
    assert [m["step"] for m in a.list_metrics(job.id)] == [1, 2]  # B stored step 2; A did not store it again


def test_a_service_stopping_during_a_launch_leaves_the_job_placing_for_the_next_one(store, cluster_view, tmp_path):
    """Stopping takes the service's Ray connection down under a launch in flight: that is not the job's failure
    (it was marked failed, after the lease had been released). The next service reattaches to it or fails it."""
    import threading

    from meridian.service.jobs import JobState

    launching, stopping = threading.Event(), threading.Event()

    class SlowStart(FakeLauncher):
        def launch(self, job_id, config, plan, *, min_workers=1):
            launching.set()
            stopping.wait(10)
            raise RuntimeError("Ray has been shut down")  # what ray.get says once the driver disconnected

    sup = Supervisor(store, SlowStart(), cluster_view, checkpoint_root=str(tmp_path), poll_interval_s=0.05)
    job, _ = sup.submit(JobRequest(name="j", model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2), {})
    sup.start()
    assert launching.wait(10)
    thread = sup._thread
    sup.stop(timeout=0.1)  # the launch is still in flight
    stopping.set()
    thread.join(10)
    status = store.get_job(job.id).status
    assert (status.state, status.reason) == (JobState.PLACING, "Placing"), status
