"""Membership decisions of an elastic job, without Ray."""

from __future__ import annotations

from dataclasses import replace

from meridian.service.runner.membership import Epoch, Form, Member, MembershipState, Wait, decide
from meridian.workers.contracts.rendezvous import JoinRequest


def m(wid, dc, node=None, t=0.0, step=0):
    request = JoinRequest(worker_id=wid, datacenter=dc, node_id=node or f"node-{wid}", address="127.0.0.1",
                          port=29500, last_step=step)
    return Member.from_request(request, joined_at=t)


ALL = {f"node-w{i}" for i in range(10)}


def first_epoch(state):
    for i, dc in enumerate(["dc-b", "dc-a", "dc-b", "dc-a"]):
        state.waiting[f"w{i}"] = m(f"w{i}", dc, t=i)
    d = decide(state, 1.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60)
    state.epoch, state.waiting = d.epoch, {}
    return d


def test_first_epoch_waits_for_the_planned_workers_then_orders_by_datacenter():
    s = MembershipState(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    s.waiting["w0"] = m("w0", "dc-b")
    assert isinstance(decide(s, 1.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60), Wait)
    d = first_epoch(s)
    assert isinstance(d, Form) and d.epoch.number == 1
    assert d.epoch.datacenters == ("dc-a", "dc-a", "dc-b", "dc-b")
    assert [x.worker_id for x in d.epoch.members] == ["w1", "w3", "w0", "w2"]


def test_a_lost_member_is_not_waited_for_once_its_node_is_dead():
    s = MembershipState(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    first_epoch(s)
    s.first_rejoin_at = 10.0
    for wid, dc in [("w0", "dc-b"), ("w2", "dc-b"), ("w3", "dc-a")]:
        s.waiting[wid] = m(wid, dc, step=7)
    # w1's node still looks alive: wait for it (within grace)
    assert isinstance(decide(s, 10.5, alive_nodes=ALL, grace_s=5, start_timeout_s=60), Wait)
    # Ray reports its node dead: form now, without w1, resuming from step 7
    d = decide(s, 10.6, alive_nodes=ALL - {"node-w1"}, grace_s=5, start_timeout_s=60)
    assert isinstance(d, Form) and [x.worker_id for x in d.lost] == ["w1"]
    assert d.epoch.datacenters == ("dc-a", "dc-b", "dc-b") and d.epoch.resume_step == 7 and d.epoch.number == 2


def test_grace_period_bounds_the_wait_for_a_silent_member():
    s = MembershipState(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    first_epoch(s)
    s.first_rejoin_at = 10.0
    for wid, dc in [("w0", "dc-b"), ("w1", "dc-a"), ("w2", "dc-b")]:
        s.waiting[wid] = m(wid, dc, step=3)
    assert isinstance(decide(s, 14.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60), Wait)
    assert isinstance(decide(s, 15.1, alive_nodes=ALL, grace_s=5, start_timeout_s=60), Form)


def test_resume_step_is_the_oldest_snapshot_among_survivors():
    s = MembershipState(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    first_epoch(s)
    s.first_rejoin_at = 1.0
    for wid, dc, step in [("w0", "dc-b", 12), ("w1", "dc-a", 11), ("w2", "dc-b", 12), ("w3", "dc-a", 11)]:
        s.waiting[wid] = m(wid, dc, step=step)
    assert decide(s, 1.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60).epoch.resume_step == 11


def test_whole_datacenter_lost_drops_out_and_min_workers_makes_the_job_wait():
    s = MembershipState(planned_workers=4, min_workers=2, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    first_epoch(s)
    s.first_rejoin_at = 1.0
    for wid, dc in [("w1", "dc-a"), ("w3", "dc-a")]:
        s.waiting[wid] = m(wid, dc, step=5)
    d = decide(s, 1.0, alive_nodes=ALL - {"node-w0", "node-w2"}, grace_s=5, start_timeout_s=60)
    assert isinstance(d, Form) and d.epoch.datacenters == ("dc-a", "dc-a")
    s.epoch, s.waiting = d.epoch, {"w1": m("w1", "dc-a", step=9)}
    s.first_rejoin_at = 2.0
    w = decide(s, 2.0, alive_nodes=ALL - {"node-w0", "node-w2", "node-w3"}, grace_s=5, start_timeout_s=60)
    assert isinstance(w, Wait) and "needs at least 2" in w.reason


def test_newcomer_waits_for_a_step_boundary_then_joins_without_state():
    s = MembershipState(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    first_epoch(s)
    s.waiting["w9"] = m("w9", "dc-a", t=50)
    assert s.newcomers_waiting()
    assert isinstance(decide(s, 51, alive_nodes=ALL, grace_s=5, start_timeout_s=60), Wait)
    s.first_rejoin_at = 60.0
    for wid, dc in [("w0", "dc-b"), ("w1", "dc-a"), ("w2", "dc-b"), ("w3", "dc-a")]:
        s.waiting[wid] = m(wid, dc, t=float(wid[1]), step=20)
    d = decide(s, 60.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60)
    assert isinstance(d, Form) and d.epoch.newcomers == ("w9",) and len(d.epoch.members) == 5
    assert d.epoch.datacenters == ("dc-a", "dc-a", "dc-a", "dc-b", "dc-b")


def test_every_member_lost_restarts_newcomers_from_the_durable_checkpoint():
    s = MembershipState(planned_workers=2, min_workers=1, dc_order=("dc-a",), first_join_at=0.0)
    s.epoch = Epoch(3, (m("w0", "dc-a"), m("w1", "dc-a")), resume_step=10)
    s.waiting["w5"] = m("w5", "dc-a")
    d = decide(s, 1.0, alive_nodes=set(), grace_s=5, start_timeout_s=60)
    assert isinstance(d, Wait) and "1 of 2 new workers have started" in d.reason  # the others are starting
    d = decide(s, 61.0, alive_nodes=set(), grace_s=5, start_timeout_s=60)
    assert isinstance(d, Form) and d.epoch.from_checkpoint and d.epoch.newcomers == ("w5",)


def test_ranks_of_one_node_are_consecutive_inside_their_datacenter():
    # Two tensor-parallel pairs pinned to nodes x and y of dc-a, joining interleaved: each pair gets adjacent
    # ranks, so tp groups (consecutive ranks) never straddle two nodes.
    s = MembershipState(planned_workers=5, min_workers=1, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    joins = [("w0", "dc-a", "x"), ("w1", "dc-a", "y"), ("w2", "dc-b", "z"), ("w3", "dc-a", "y"), ("w4", "dc-a", "x")]
    for t, (wid, dc, node) in enumerate(joins):
        s.waiting[wid] = m(wid, dc, node=node, t=t)
    d = decide(s, 10.0, alive_nodes={"x", "y", "z"}, grace_s=5, start_timeout_s=60)
    assert [x.worker_id for x in d.epoch.members] == ["w0", "w4", "w1", "w3", "w2"]


def test_every_member_gone_with_new_workers_holding_their_snapshots_resumes_from_those():
    # A Train run ended with its workers while their nodes lived: the new run's workers took over the ended ones'
    # snapshot folders (workers/state/snapshot_paths.adopt_orphan) and join with their last steps.
    s = MembershipState(planned_workers=3, min_workers=1, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    s.epoch = Epoch(3, (m("w0", "dc-a"), m("w1", "dc-b"), m("w2", "dc-b")), resume_step=10)
    s.waiting.update({"n0": m("n0", "dc-a", step=24), "n1": m("n1", "dc-b", step=25), "n2": m("n2", "dc-b")})
    d = decide(s, 1.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60, gone={"w0", "w1", "w2"})
    assert isinstance(d, Form) and not d.epoch.from_checkpoint
    assert d.epoch.resume_step == 24  # the newest step every worker holding shards has
    assert set(d.epoch.newcomers) == {"n0", "n1", "n2"} and len(d.lost) == 3


def test_every_member_gone_a_stale_folder_taken_over_does_not_send_the_job_back_to_its_step():
    # n2 took over the folder of a worker lost at step 3 that nobody had taken over since (its host had more new
    # workers than fresh folders). No other folder keeps step 3: resuming there lost the state.
    s = MembershipState(planned_workers=3, min_workers=1, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    s.epoch = Epoch(3, (m("w0", "dc-a"), m("w1", "dc-b"), m("w2", "dc-b")), resume_step=10)
    s.waiting.update({"n0": m("n0", "dc-a", step=24), "n1": m("n1", "dc-b", step=25), "n2": m("n2", "dc-b", step=3)})
    d = decide(s, 1.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60, gone={"w0", "w1", "w2"})
    assert isinstance(d, Form) and not d.epoch.from_checkpoint
    assert d.epoch.resume_step == 24 and set(d.epoch.newcomers) == {"n0", "n1", "n2"}
    # Snapshots 10 steps apart: a folder at step 40 keeps 40, 30 and 20, so 20 is shared and 10 is not.
    for n2_step, resume in ((20, 20), (10, 40)):
        s.waiting = {w: replace(m(w, dc, step=step), snapshot_every=10)
                     for w, dc, step in (("n0", "dc-a", 40), ("n1", "dc-b", 40), ("n2", "dc-b", n2_step))}
        d = decide(s, 1.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60, gone={"w0", "w1", "w2"})
        assert d.epoch.resume_step == resume


def test_every_member_gone_below_min_workers_waits_and_says_min_workers():
    # The same restart, but only two of the ended run's workers could be placed again (their datacenter's other
    # nodes are gone) and the job needs three: it waits, naming the setting that holds it, the way a re-formation
    # below min_workers does (a user reads one reason, whichever path the loss took).
    s = MembershipState(planned_workers=4, min_workers=3, dc_order=("dc-a", "dc-b"), first_join_at=0.0)
    s.epoch = Epoch(3, (m("w0", "dc-a"), m("w1", "dc-b"), m("w2", "dc-b")), resume_step=10)
    s.waiting.update({"n1": m("n1", "dc-b", step=25), "n2": m("n2", "dc-b", step=25)})
    w = decide(s, 1.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60, gone={"w0", "w1", "w2"})
    assert isinstance(w, Wait)
    assert "2 new worker(s) started" in w.reason and "at least 3 (topology.min_workers)" in w.reason
    s.waiting["n3"] = m("n3", "dc-a", t=2.0)  # capacity returned in dc-a: a third worker joins
    d = decide(s, 2.0, alive_nodes=ALL, grace_s=5, start_timeout_s=60, gone={"w0", "w1", "w2"})
    assert isinstance(d, Wait) and "3 of 4 new workers have started" in d.reason  # the run's own may be starting


def test_a_newcomer_on_a_node_ray_reports_dead_is_not_formed_with_nor_asked_for():
    s = MembershipState(planned_workers=2, min_workers=1, dc_order=("dc-a",), first_join_at=0.0)
    s.epoch = Epoch(1, (m("w0", "dc-a", step=0), m("w1", "dc-a", step=0)), resume_step=0, newcomers=("w0", "w1"))
    s.waiting = {"w5": m("w5", "dc-a", t=1.0), "w0": m("w0", "dc-a", step=9), "w1": m("w1", "dc-a", step=9)}
    s.first_rejoin_at = 10.0
    alive = ALL - {"node-w5"}  # the members left at step 9 for w5, whose node died meanwhile
    d = decide(s, 10.0, alive_nodes=alive, grace_s=30, start_timeout_s=300)
    assert isinstance(d, Form) and [x.worker_id for x in d.epoch.members] == ["w0", "w1"] and d.epoch.newcomers == ()
    s.epoch, s.waiting = d.epoch, {"w5": s.waiting["w5"]}
    # and the members of the new epoch are not asked to re-form for it at every step boundary
    assert not s.newcomers_waiting(alive) and s.newcomers_waiting(ALL)


def test_an_epochs_ranks_newcomer_ranks_and_cadence_follow_its_member_order():
    members = tuple(Member(worker_id=f"w{i}", datacenter=f"dc-{i % 2}", node_id=f"n{i // 8}", address="a",
                           joined_at=float(i), snapshot_every=1 + i % 3) for i in range(40))
    e = Epoch(3, members, resume_step=7, newcomers=("w5", "w0", "w39"))
    assert [e.rank_of(m.worker_id) for m in members] == list(range(40))
    assert e.newcomer_ranks == (5, 0, 39)
    assert e.datacenters == tuple(m.datacenter for m in members)
    assert e.snapshot_every == 3
    assert e.has("w12") and not e.has("w40")
    assert e == Epoch(3, members, resume_step=7, newcomers=("w5", "w0", "w39"))  # the cached views are not fields
