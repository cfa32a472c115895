"""The rendezvous coordinator with real threads standing in for workers (no Ray)."""

from __future__ import annotations

import threading
import time

import pytest
from fakes import join_concurrently

from meridian.service.runner.coordinator import Coordinator
from meridian.workers.contracts.rendezvous import Assignment, Finished, JoinRequest, Waiting


def member(i, dc, step=0, snapshot_every=1):
    return JoinRequest(worker_id=f"w{i}", datacenter=dc, node_id=f"n{i}", address="127.0.0.1", port=29500 + i,
                       last_step=step, snapshot_every=snapshot_every)


def test_workers_get_ranks_grouped_by_datacenter_and_rank0_hosts_the_store():
    events = []
    c = Coordinator(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"), on_event=lambda *e: events.append(e))
    threads, out = join_concurrently(c, [member(0, "dc-b"), member(1, "dc-a"), member(2, "dc-b"), member(3, "dc-a")])
    for t in threads:
        t.join(10)
    assert sorted(a.rank for a in out.values()) == [0, 1, 2, 3]
    assert out["w1"].datacenters == ("dc-a", "dc-a", "dc-b", "dc-b")
    rank0 = next(w for w, a in out.items() if a.rank == 0)
    assert out["w0"].master_port == 29500 + int(rank0[1])
    assert [e[0] for e in events][-1] == "epoch_formed"


def test_survivors_re_form_without_the_dead_member_and_resume_from_the_oldest_snapshot():
    events = []
    c = Coordinator(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"), on_event=lambda *e: events.append(e),
                    grace_s=30)
    threads, _ = join_concurrently(c, [member(i, dc) for i, dc in enumerate(["dc-a", "dc-a", "dc-b", "dc-b"])])
    for t in threads:
        t.join(10)
    threads, out = join_concurrently(c, [member(0, "dc-a", step=9), member(2, "dc-b", step=10), member(3, "dc-b", step=10)],
                            known_epoch=1)
    c.tick({"n0", "n1", "n2", "n3"})  # n1 still looks alive: keep waiting (grace 30 s)
    assert not out
    c.tick({"n0", "n2", "n3"})  # Ray reports n1 dead: form at once
    for t in threads:
        t.join(10)
    a = out["w2"]
    assert a.epoch == 2 and a.world_size == 3 and a.datacenters == ("dc-a", "dc-b", "dc-b")
    assert a.resume_step == 9
    kinds = [e[0] for e in events]
    assert "worker_lost" in kinds and kinds[-1] == "epoch_formed"


def test_newcomer_is_signalled_to_members_and_joins_at_the_next_boundary():
    c = Coordinator(planned_workers=2, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: None)
    threads, _ = join_concurrently(c, [member(0, "dc-a"), member(1, "dc-a")])
    for t in threads:
        t.join(10)
    assert not c.pending_change(1)
    newcomer_threads, newcomer = join_concurrently(c, [member(5, "dc-a")])
    assert isinstance(c.join(member(5, "dc-a"), poll_s=0.1), Waiting)
    assert c.pending_change(1)
    threads, out = join_concurrently(c, [member(0, "dc-a", step=4), member(1, "dc-a", step=4)], known_epoch=1)
    for t in threads + newcomer_threads:
        t.join(10)
    assert newcomer["w5"].newcomer_ranks == (2,) and newcomer["w5"].world_size == 3
    assert newcomer["w5"].is_newcomer and not out["w0"].is_newcomer
    assert out["w0"].resume_step == 4


def two_in_dc_a():
    """A coordinator whose first epoch formed with w0 and w1 in dc-a; its events; their assignments."""
    events = []
    c = Coordinator(planned_workers=2, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: events.append(e))
    threads, first = join_concurrently(c, [member(0, "dc-a"), member(1, "dc-a")])
    for t in threads:
        t.join(10)
    return c, events, first


def test_a_re_formed_epoch_starts_every_rank_at_the_widest_snapshot_cadence_agreed_so_far():
    c, events, first = two_in_dc_a()
    assert {a.snapshot_every for a in first.values()} == {1}
    newcomer_threads, newcomer = join_concurrently(c, [member(5, "dc-a")])  # a new worker knows none
    threads, out = join_concurrently(c, [member(0, "dc-a", step=17, snapshot_every=17),
                                         member(1, "dc-a", step=17, snapshot_every=17)], known_epoch=1)
    for t in threads + newcomer_threads:
        t.join(10)
    assert {a.snapshot_every for a in [*out.values(), *newcomer.values()]} == {17}  # the same on every rank
    assert events[-1][0] == "epoch_formed" and events[-1][2]["snapshot_every"] == 17


def test_every_poll_of_one_join_offers_the_same_store_port():
    # The epoch can form between two polls; the others are told the port of the last poll they saw, so a
    # worker that offered a new port on every poll could host its store where nobody connects.
    from meridian.workers.elastic.rendezvous import Rendezvous

    ports = []

    def call(method, request, epoch):
        ports.append(request.port)
        if len(ports) < 3:
            return Waiting("2 of 3 workers have started")
        return Assignment.of(epoch=1, rank=0, world_size=3, datacenters=("a", "a", "b"), master_addr="127.0.0.1",
                          master_port=ports[-1], resume_step=0, from_checkpoint=False, newcomer_ranks=(0, 1, 2))

    rdzv = Rendezvous(call, worker_id="w0", datacenter="a", node_id="n0", address="127.0.0.1")
    assert rdzv.join(last_step=0, timeout_s=10).master_port == ports[0]
    assert len(ports) == 3 and len(set(ports)) == 1


def test_a_joiner_hosts_its_store_while_it_waits_so_peers_never_race_it():
    # A store started only when the epoch formed raced its clients: one that found nothing listening backed
    # off 0.3-0.65 s before trying again, on every re-formation where rank 0 was not first.
    from datetime import timedelta

    import torch.distributed as dist

    from meridian.workers.elastic.rendezvous import Rendezvous

    seen = []

    def call(method, request, epoch):
        # A peer connects to the offered port while this worker still waits: something answers already.
        peer = dist.TCPStore("127.0.0.1", request.port, is_master=False, timeout=timedelta(seconds=2))
        peer.set("hello", "there")
        seen.append(request.port)
        return Assignment.of(epoch=1, rank=0, world_size=2, datacenters=("a", "b"), master_addr="127.0.0.1",
                          master_port=request.port, resume_step=0, from_checkpoint=False, newcomer_ranks=(0, 1))

    rdzv = Rendezvous(call, worker_id="w0", datacenter="a", node_id="n0", address="127.0.0.1")
    a = rdzv.join(last_step=0, timeout_s=10)
    assert seen == [a.master_port]
    assert rdzv._store is not None and rdzv._store.get("hello") == b"there"  # the store rank 0 will form on


def test_a_standby_s_store_serves_its_first_join_with_the_job_s_timeout_and_forms_the_group():
    # Hosting a store took a cold training process 8-20 ms on two busy cores, on the critical path of every
    # re-formation; a standby hosts it while it waits for its go.
    from datetime import timedelta

    import torch.distributed as dist

    from meridian.workers.elastic.rendezvous import Rendezvous, prehost_store

    store = prehost_store()
    assert store is not None
    offered = []

    def call(method, request, epoch):
        offered.append(request.port)
        return Assignment.of(epoch=epoch + 1, rank=0, world_size=1, datacenters=("a",), master_addr="127.0.0.1",
                          master_port=request.port, resume_step=0, from_checkpoint=False, newcomer_ranks=(0,))

    rdzv = Rendezvous(call, worker_id="w0", datacenter="a", node_id="n0", address="127.0.0.1",
                      collective_timeout_s=42, backend="gloo", store=store)  # fmt: skip
    a = rdzv.join(last_step=0, timeout_s=10)
    assert offered == [store.port] and store.timeout == timedelta(seconds=42)
    rdzv.form(a)
    try:
        assert dist.get_world_size() == 1 and rdzv._store is None  # the group holds it now
    finally:
        Rendezvous.teardown()
    rdzv.join(last_step=0, timeout_s=10)  # the next join hosts a store of its own
    assert len(offered) == 2 and rdzv._store is not None and rdzv._store is not store


def test_a_taken_low_port_is_skipped_for_sockets_and_stores_alike_and_port_0_is_the_last_resort():
    from meridian.workers.distributed.ports import LOW_PORTS, on_low_port

    tried = []

    def bind(port):  # a socket's bind raises OSError when taken, a TCPStore's DistNetworkError (a RuntimeError)
        tried.append(port)
        if len(tried) < 3:
            raise (OSError if len(tried) == 1 else RuntimeError)("address in use")
        return port

    assert on_low_port(bind) == tried[-1] and len(tried) == 3 and all(p in LOW_PORTS for p in tried)
    tried.clear()

    def all_taken(port):
        tried.append(port)
        if port:
            raise OSError("address in use")
        return port

    assert on_low_port(all_taken) == 0 and len(tried) == 101


def test_rank_0_told_a_store_port_it_does_not_host_leaves_to_join_again():
    from meridian.workers.elastic.rendezvous import Rendezvous, StoreNotHosted
    from meridian.workers.elastic.trainer import is_peer_failure

    def call(method, request, epoch):
        return Assignment.of(epoch=1, rank=0, world_size=2, datacenters=("a", "b"), master_addr="127.0.0.1",
                          master_port=request.port + 1, resume_step=0, from_checkpoint=False, newcomer_ranks=(0, 1))

    rdzv = Rendezvous(call, worker_id="w0", datacenter="a", node_id="n0", address="127.0.0.1",
                      collective_timeout_s=5)  # fmt: skip
    a = rdzv.join(last_step=0, timeout_s=10)
    with pytest.raises(StoreNotHosted, match=f"names store port {a.master_port}") as e:
        rdzv.form(a)
    assert is_peer_failure(e.value)  # the trainer rejoins instead of failing the job


def test_a_worker_joining_after_the_last_step_is_told_the_job_finished():
    from meridian.workers.elastic.rendezvous import JobFinished, Rendezvous

    c = Coordinator(planned_workers=1, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: None)
    threads, out = join_concurrently(c, [member(0, "dc-a")])
    for t in threads:
        t.join(10)
    assert out["w0"].rank == 0 and not c.job_finished
    c.finish("w0")
    assert isinstance(c.join(member(1, "dc-a"), poll_s=0.1), Finished)
    # The worker side turns the reply into JobFinished (its agent returns without training).
    rdzv = Rendezvous(lambda method, *args: getattr(c, method)(*args), worker_id="w1", datacenter="dc-a",
                      node_id="n1", address="127.0.0.1")
    with pytest.raises(JobFinished):
        rdzv.join(last_step=0, timeout_s=5)


def _two_members_formed(now, probes, on_event):
    """A coordinator on the clock ``now[0]`` whose first epoch holds w0 and w1 (liveness ports 39500, 39501)."""
    c = Coordinator(planned_workers=2, min_workers=1, dc_order=("dc-a",), on_event=on_event, clock=lambda: now[0],
                    probes=probes)
    old = [JoinRequest(worker_id=f"w{i}", datacenter="dc-a", node_id=f"n{i}", address="127.0.0.1", port=29500 + i,
                       probe_port=39500 + i) for i in range(2)]  # fmt: skip
    threads, _ = join_concurrently(c, old)
    for t in threads:
        t.join(10)
    return c


def test_newcomers_waiting_for_members_that_are_all_gone_probe_them_and_re_form_alone():
    # A Train run ended with all its workers while their nodes lived: no member will rejoin or reach a step
    # boundary, so after NEWCOMERS_PROBE_AFTER_S of waiting the ticks probe the members and find them gone.
    from meridian.service.runner.coordinator import NEWCOMERS_PROBE_AFTER_S
    from meridian.service.runner.liveness.judge import Probe
    from meridian.service.runner.liveness.probes import Probes

    now, dead = [0.0], set()
    probes = Probes(probe_fn=lambda address, port: Probe.GONE if port in dead else Probe.ALIVE)
    c = _two_members_formed(now, probes, on_event=lambda *e: None)
    dead.update({39500, 39501})  # both members' agents died with their run
    new = [JoinRequest(worker_id=f"w{i}", datacenter="dc-a", node_id=f"n{i - 3}", address="127.0.0.1",
                       port=29500 + i, probe_port=39500 + i, last_step=7) for i in (3, 4)]  # fmt: skip
    for r in new:
        assert isinstance(c.join(r, poll_s=0.0), Waiting)
    c.tick({"n0", "n1"})
    assert c.epoch.number == 1 and not c.left_behind  # not yet: members normally reach a boundary within a step
    now[0] = NEWCOMERS_PROBE_AFTER_S
    c.tick({"n0", "n1"})
    assert c.left_behind == {"w0", "w1"} and c.epoch.number == 2
    assert c.epoch.resume_step == 7 and {m.worker_id for m in c.epoch.members} == {"w3", "w4"}


def test_newcomers_waiting_a_minute_on_members_that_answer_stop_them():
    # Members that answer their probes but reach no step boundary for NEWCOMERS_ABORT_AFTER_S are stuck: they
    # are told to stop (once per epoch), so their next processes rejoin with the newcomers.
    from meridian.service.runner.liveness.judge import LivenessPolicy, Probe
    from meridian.service.runner.liveness.probes import Probes

    NEWCOMERS_ABORT_AFTER_S = LivenessPolicy().newcomers_abort_after_s
    now, told = [0.0], []
    probes = Probes(probe_fn=lambda address, port: Probe.ALIVE,
                    abort_fn=lambda address, port, epoch: told.append((port, epoch)) or True)
    events = []
    c = _two_members_formed(now, probes, on_event=lambda *e: events.append(e))
    assert isinstance(c.join(JoinRequest(worker_id="w5", datacenter="dc-a", node_id="n5", address="127.0.0.1",
                                         port=29505, probe_port=39505), poll_s=0.0), Waiting)  # fmt: skip
    now[0] = NEWCOMERS_ABORT_AFTER_S - 1
    c.tick({"n0", "n1", "n5"})
    assert told == []
    now[0] = NEWCOMERS_ABORT_AFTER_S
    c.tick({"n0", "n1", "n5"})
    c.tick({"n0", "n1", "n5"})
    assert sorted(told) == [(39500, 1), (39501, 1)]  # each member once
    stuck = [e for e in events if e[0] == "worker_stuck"]
    assert len(stuck) == 2 and "no step boundary while new workers waited 60 s" in stuck[0][1]


def test_a_closed_coordinator_forms_no_epoch_and_tells_joins_to_end():
    # A cancelled job: its members die with Ray Train's controller, and a worker that outlives them (the runner's
    # replacement) must not form an epoch alone and restart the job from its checkpoint.
    c, events, _ = two_in_dc_a()
    replies = []
    newcomer = threading.Thread(target=lambda: replies.append(c.join(member(5, "dc-a"), poll_s=30)))
    newcomer.start()  # waits for the members' next step boundary
    time.sleep(0.3)
    began = time.monotonic()
    c.close()
    newcomer.join(10)
    assert isinstance(replies[0], Finished) and time.monotonic() - began < 5  # woken by the close, not its poll
    assert isinstance(c.join(member(1, "dc-a", step=7), known_epoch=1, poll_s=0.1), Finished)
    c.tick({"n1"})  # its peers' nodes are gone: an open coordinator would re-form now
    assert [e[0] for e in events].count("epoch_formed") == 1


def test_a_newcomer_whose_first_epoch_broke_before_it_restored_receives_the_state_again():
    # It holds no snapshot yet and rejoins with last_step 0. Taken as the step everyone holds, it sent the job back to
    # step 0 (every rank found its state incomplete, fell back to step 0 and discarded its newer snapshots).
    c = Coordinator(planned_workers=2, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: None, grace_s=30)
    threads, _ = join_concurrently(c, [member(0, "dc-a"), member(1, "dc-a")])
    for t in threads:
        t.join(10)
    newcomer_threads, newcomer = join_concurrently(c, [member(2, "dc-a")])
    threads, _ = join_concurrently(c, [member(0, "dc-a", step=8), member(1, "dc-a", step=8)], known_epoch=1)
    for t in threads + newcomer_threads:
        t.join(10)
    assert (newcomer["w2"].epoch, newcomer["w2"].resume_step, newcomer["w2"].is_newcomer) == (2, 8, True)
    threads, out = join_concurrently(c, [member(0, "dc-a", step=8), member(1, "dc-a", step=8), member(2, "dc-a")],
                                     known_epoch=2)
    for t in threads:
        t.join(10)
    assert {a.epoch for a in out.values()} == {3} and out["w0"].resume_step == 8 and not out["w0"].from_checkpoint
    assert out["w2"].is_newcomer and not out["w0"].is_newcomer


def test_an_epoch_formed_between_two_calls_of_a_worker_is_its_answer_not_a_rejoin():
    events = []
    c = Coordinator(planned_workers=2, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: events.append(e),
                    grace_s=30)
    assert isinstance(c.join(member(0, "dc-a"), known_epoch=0, poll_s=0.05), Waiting)  # w0 is between two calls
    assert isinstance(c.join(member(1, "dc-a"), known_epoch=0, poll_s=0.05), Assignment)  # epoch 1 forms with both
    again = c.join(member(0, "dc-a"), known_epoch=0, poll_s=0.05)
    # Before: w0 was registered as rejoining epoch 1 and told to wait, so its peer could never form the group.
    assert isinstance(again, Assignment) and again.epoch == 1 and c.state.first_rejoin_at is None
    assert [e[0] for e in events].count("epoch_formed") == 1 and not c.state.waiting


def test_joins_beyond_the_calls_it_holds_are_registered_answered_at_once_and_assigned_on_their_next_call():
    c = Coordinator(planned_workers=3, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: None, max_waiters=1)
    out = {}
    held = threading.Thread(target=lambda: out.setdefault("w0", c.join(member(0, "dc-a"), poll_s=30)))
    held.start()
    deadline = time.monotonic() + 10
    while c._waiters < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    reply = c.join(member(1, "dc-a"), poll_s=30)
    assert isinstance(reply, Waiting) and reply.retry_after_s > 0 and "2 of 3" in reply.reason
    assert time.monotonic() - started < 10  # answered without waiting its 30 s poll
    assert "w1" in c.state.waiting  # but registered: the epoch can form with it
    third = c.join(member(2, "dc-a"), poll_s=30)  # the last one forms the epoch
    held.join(10)
    assert isinstance(third, Assignment) and isinstance(out["w0"], Assignment)
    again = c.join(member(1, "dc-a"), poll_s=30)
    assert isinstance(again, Assignment) and again.epoch == 1
    assert sorted(a.rank for a in (out["w0"], again, third)) == [0, 1, 2]
