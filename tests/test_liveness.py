"""Detecting a dead member without Ray: the agent's liveness port, the probe, and the coordinator re-forming
as soon as a silent member's process is known gone (deterministic fakes for the probe; real sockets for the
port itself)."""

from __future__ import annotations

import socket
import threading
import time

from fakes import join_concurrently

from meridian.service.runner.coordinator import Coordinator
from meridian.service.runner.liveness.judge import Liveness, LivenessPolicy, Probe, RankSeen, Seen, judge
from meridian.service.runner.liveness.probes import Probes, probe, send_abort
from meridian.service.runner.membership import Epoch, Member, MembershipState, decide
from meridian.workers.contracts.rendezvous import Assignment, JoinRequest, Waiting
from meridian.workers.elastic.agent import Agent
from meridian.workers.elastic.liveness import LivenessListener, parse_abort


def test_the_port_answers_while_the_listener_lives_and_refuses_after():
    listener = LivenessListener("127.0.0.1")
    try:
        assert probe("127.0.0.1", listener.port) is Probe.ALIVE
        assert probe("127.0.0.1", listener.port) is Probe.ALIVE  # one connection does not use it up
    finally:
        listener.close()
    assert probe("127.0.0.1", listener.port) is Probe.GONE


def _dead_after(probes: Probes, suspects) -> set[str]:
    """Probe ``suspects`` once, then judge them as members that have not rejoined: the ids judged dead."""
    probes.probe_each(suspects)
    ranks = []
    for i, (wid, _, port) in enumerate(suspects):
        last, misses = probes.seen(wid)
        ranks.append(RankSeen(worker_id=wid, rank=i, node_id=f"n{i}", datacenter="dc-a", probe_port=port,
                              probe=last, misses=misses))
    return {v.worker_id for v in judge(Seen(now=0.0, epoch=1, ranks=tuple(ranks))) if v.liveness is Liveness.DEAD}


def test_refused_is_gone_at_once_unreachable_only_when_repeated_and_an_answer_resets_it():
    answers = {"a": [Probe.GONE], "b": [Probe.UNREACHABLE, Probe.ALIVE, Probe.UNREACHABLE, Probe.UNREACHABLE],
               "c": [Probe.ALIVE] * 4}
    asked: list[str] = []

    def fake(address, port):
        asked.append(address)
        return answers[address].pop(0)

    t = Probes(probe_fn=fake)
    live = [("wb", "b", 2), ("wc", "c", 3), ("wz", "z", 0)]
    assert _dead_after(t, [("wa", "a", 1), *live]) == {"wa"}
    assert _dead_after(t, live) == set()  # b answered this time
    assert _dead_after(t, live) == set()  # one miss
    assert _dead_after(t, live) == {"wb"}  # two in a row
    assert "z" not in asked  # a worker without a port is never probed


def _m(i, dc, port=0):
    return Member(worker_id=f"w{i}", datacenter=dc, node_id=f"n{i}", address=f"10.0.0.{i}", joined_at=float(i),
                  last_step=5, probe_port=port)


def test_decide_does_not_wait_for_a_member_known_gone_although_its_node_looks_alive():
    members = tuple(_m(i, dc) for i, dc in enumerate(["dc-a", "dc-a", "dc-b", "dc-b"]))
    state = MembershipState(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"),
                            epoch=Epoch(1, members, resume_step=0), first_rejoin_at=100.0)
    state.waiting = {m.worker_id: m for m in members if m.worker_id != "w3"}
    alive = {"n0", "n1", "n2", "n3"}
    assert type(decide(state, 101.0, alive_nodes=alive, grace_s=30, start_timeout_s=1)).__name__ == "Wait"
    form = decide(state, 101.0, alive_nodes=alive, grace_s=30, start_timeout_s=1, gone={"w3"})
    assert [m.worker_id for m in form.epoch.members] == ["w0", "w1", "w2"]
    assert [m.worker_id for m in form.lost] == ["w3"]


def _request(i, dc, step=0):
    return JoinRequest(worker_id=f"w{i}", datacenter=dc, node_id=f"n{i}", address=f"10.0.0.{i}", port=29500 + i,
                       last_step=step, probe_port=40000 + i)


def _join(coord, requests, known_epoch):
    """Join them all at once; the assignments, once every thread is done."""
    threads, out = join_concurrently(coord, requests, known_epoch, poll_s=0.1)
    for t in threads:
        t.join(20)
    return out


def _formed_coordinator(answer):
    events: list[tuple] = []
    probed: list[str] = []

    def fake(address, port):
        probed.append(address)
        return answer(address)

    c = Coordinator(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"), on_event=lambda *e: events.append(e),
                    grace_s=30, probes=Probes(probe_fn=fake))
    dcs = ["dc-a", "dc-a", "dc-b", "dc-b"]
    _join(c, [_request(i, dc) for i, dc in enumerate(dcs)], 0)
    assert c.epoch.number == 1 and not probed  # nobody is probed while no re-formation is pending
    return c, events, probed


def test_survivors_re_form_at_once_when_the_silent_member_is_gone_though_ray_says_its_node_lives():
    c, events, probed = _formed_coordinator(lambda address: Probe.GONE if address == "10.0.0.3" else Probe.ALIVE)
    c.tick({"n0", "n1", "n2", "n3"})  # Ray still reports every node alive
    out = _join(c, [_request(0, "dc-a", 7), _request(1, "dc-a", 7), _request(2, "dc-b", 7)], 1)
    assert {a.world_size for a in out.values()} == {3} and {a.epoch for a in out.values()} == {2}
    assert {a.resume_step for a in out.values()} == {7}
    assert "10.0.0.3" in probed
    kinds = [e[0] for e in events]
    assert "worker_gone" in kinds and kinds.index("worker_gone") < len(kinds) - 1 - kinds[::-1].index("epoch_formed")


def test_a_silent_member_whose_port_closes_after_the_first_rejoin_is_found_gone_without_waiting_for_a_tick():
    # A killed process's port refuses only once its memory is freed: the first rejoin's probe found it answering,
    # and until the runner's next tick (0.5 s) nobody looked again.
    closes_at = [float("inf")]
    c, events, probed = _formed_coordinator(
        lambda address: Probe.GONE if address == "10.0.0.3" and time.monotonic() >= closes_at[0] else Probe.ALIVE)
    requests = [_request(0, "dc-a", 7), _request(1, "dc-a", 7), _request(2, "dc-b", 7)]
    threads, result = join_concurrently(c, requests, 1, poll_s=2.0)
    for _ in range(200):  # the three survivors wait in the rendezvous; w3 answered their probes
        if len(c.status()["waiting"]) == 3:
            break
        time.sleep(0.01)
    assert probed.count("10.0.0.3") >= 1 and c.epoch.number == 1
    closes_at[0] = time.monotonic()  # its process is gone now; no tick comes
    for t in threads:
        t.join(5)
    formed_after = time.monotonic() - closes_at[0]
    assert {a.world_size for a in result.values()} == {3} and len(result) == 3
    assert formed_after < 1.0, formed_after  # each waiting call looked again within 20 ms; the poll was 2 s
    assert [e[0] for e in events].count("worker_gone") == 1


def test_a_silent_member_that_still_answers_is_waited_for():
    c, events, _ = _formed_coordinator(lambda address: Probe.ALIVE)
    result: dict[str, Assignment] = {}
    t = threading.Thread(target=lambda: result.update(_join(c, [_request(0, "dc-a", 7), _request(1, "dc-a", 7),
                                                                 _request(2, "dc-b", 7)], 1)))
    t.start()
    for _ in range(200):  # until the three survivors are all waiting in the rendezvous
        if len(c.status()["waiting"]) == 3:
            break
        time.sleep(0.05)
    for _ in range(5):
        c.tick({"n0", "n1", "n2", "n3"})
    assert c.epoch.number == 1 and "worker_gone" not in [e[0] for e in events]
    c.join(_request(3, "dc-b", 7), known_epoch=1, poll_s=0.1)  # it was only slow: everyone re-forms with it
    t.join(20)
    assert {a.world_size for a in result.values()} == {4}


# -- stopping a member that answers but does not rejoin ----------------------------------------------------------
def test_the_port_carries_an_abort_of_one_epoch_and_a_probe_or_garbage_triggers_nothing():
    told: list[int] = []
    listener = LivenessListener("127.0.0.1", on_abort=told.append)
    try:
        assert probe("127.0.0.1", listener.port) is Probe.ALIVE
        with socket.create_connection(("127.0.0.1", listener.port)) as conn:
            conn.sendall(b"hello 3\n")
        assert send_abort("127.0.0.1", listener.port, 7)  # answered once the agent has acted
        assert told == [7]
    finally:
        listener.close()
    assert not send_abort("127.0.0.1", listener.port, 8)  # nobody listens any more
    assert parse_abort(b"abort 12\n") == 12 and parse_abort(b"abort x") is None and parse_abort(b"") is None


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _coordinator(clock, told: list, events: list | None = None) -> Coordinator:
    """Four members over two datacenters, formed; probes find every agent alive and aborts are recorded in
    ``told``; abort_after_s is grace_s / 3 (10 s)."""
    tracker = Probes(probe_fn=lambda address, port: Probe.ALIVE,
                     abort_fn=lambda address, port, epoch: told.append((address, port, epoch)) or True)
    c = Coordinator(planned_workers=4, min_workers=1, dc_order=("dc-a", "dc-b"),
                    on_event=lambda *e: events.append(e) if events is not None else None,
                    grace_s=30, probes=tracker, clock=clock)
    for i, dc in enumerate(["dc-a", "dc-a", "dc-b", "dc-b"]):
        c.join(_request(i, dc), known_epoch=0, poll_s=0)
    return c


def test_a_member_that_answers_but_stays_silent_is_told_to_stop_once_after_abort_after_s():
    told: list[tuple[str, int, int]] = []
    events: list[tuple] = []
    clock = _Clock()
    c = _coordinator(clock, told, events)
    assert c.epoch.number == 1
    for i, dc in enumerate(["dc-a", "dc-a", "dc-b"]):  # three members rejoin: their epoch broke
        c.join(_request(i, dc, 7), known_epoch=1, poll_s=0)
    clock.t += 9.0
    c.tick({"n0", "n1", "n2", "n3"})
    assert told == []  # not yet: it may be on its way
    clock.t += 1.0
    c.tick({"n0", "n1", "n2", "n3"})
    c.tick({"n0", "n1", "n2", "n3"})
    assert told == [("10.0.0.3", 40003, 1)]  # once, naming the epoch it must leave
    clock.t += 29.0
    c.tick({"n0", "n1", "n2", "n3"})
    assert c.epoch.number == 1  # told to stop, it has a fresh grace period to come back in
    stuck = [e for e in events if e[0] == "worker_stuck"]
    assert len(stuck) == 1 and stuck[0][2] == {"worker_id": "w3", "epoch": 1} and "dc-b" in stuck[0][1]
    c.join(_request(3, "dc-b", 7), known_epoch=1, poll_s=0)  # its next process rejoins: everyone re-forms
    assert c.epoch.number == 2 and len(c.epoch.members) == 4 and "worker_lost" not in [e[0] for e in events]


def test_the_agent_stops_only_a_child_still_training_in_the_named_epoch():
    agent = Agent.__new__(Agent)  # only the state abort() reads
    agent._lock, agent.aborts, agent._aborted = threading.Lock(), 0, None
    child = _FakeChild()
    agent._child, agent._joining, agent.ids = child, False, {"epoch": 4}
    agent.abort(3)  # an older epoch: it already left that one
    agent._joining = True
    agent.abort(4)  # it is rejoining: nothing to stop
    assert not child.killed and agent.aborts == 0
    agent._joining = False
    agent.abort(4)
    assert child.killed and agent._aborted is child and agent.aborts == 1


class _FakeChild:
    killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True


def test_waiting_workers_whose_processes_are_gone_are_not_formed_with(monkeypatch):
    # Seen after Ray Train's controller failed: the ended run's workers had joined while the job waited below
    # min_workers, their processes were shut down with the run, and an epoch formed with them and a new worker.
    import meridian.service.runner.coordinator as coordinator

    monkeypatch.setattr(coordinator, "STALE_POLL_S", 0.3)
    dead = {"10.0.0.0", "10.0.0.1"}
    events: list[tuple] = []
    c = Coordinator(planned_workers=3, min_workers=3, dc_order=("dc-a", "dc-b"), on_event=lambda *e: events.append(e),
                    probes=Probes(probe_fn=lambda address, port: Probe.GONE if address in dead else Probe.ALIVE))
    for i, dc in ((0, "dc-b"), (1, "dc-b")):  # they join, wait, then their processes die: no more calls
        assert isinstance(c.join(_request(i, dc), poll_s=0.05), Waiting)
    time.sleep(0.4)
    assert isinstance(c.join(_request(2, "dc-a"), poll_s=0.05), Waiting)  # not an epoch with the two dead
    assert c.epoch is None and sorted(c.status()["waiting"]) == ["w2"]
    assert sorted(e[2]["worker_id"] for e in events if e[0] == "worker_gone") == ["w0", "w1"]
    out = _join(c, [_request(2, "dc-a"), _request(3, "dc-b"), _request(4, "dc-b")], 0)  # the new run's workers
    assert sorted(out) == ["w2", "w3", "w4"] and {a.world_size for a in out.values()} == {3}


def test_a_waiting_worker_that_stopped_calling_but_answers_is_kept(monkeypatch):
    import meridian.service.runner.coordinator as coordinator

    monkeypatch.setattr(coordinator, "STALE_POLL_S", 0.3)
    c = Coordinator(planned_workers=3, min_workers=3, dc_order=("dc-a", "dc-b"), on_event=lambda *e: None,
                    probes=Probes(probe_fn=lambda address, port: Probe.ALIVE))
    for i, dc in ((0, "dc-b"), (1, "dc-b")):
        c.join(_request(i, dc), poll_s=0.05)
    time.sleep(0.4)  # slow, not gone: its agent answers
    out = _join(c, [_request(2, "dc-a")], 0)
    assert out["w2"].world_size == 3


def test_members_stranded_with_a_member_whose_node_died_silently_are_told_to_stop():
    # A host that loses its power or its network closes no socket: its peers' collectives wait on it for the
    # whole collective timeout, so none of them rejoins. Ray's view of the node is the evidence then.
    told: list[tuple[str, int, int]] = []
    events: list[tuple] = []
    clock = _Clock()
    c = _coordinator(clock, told, events)
    c.tick({"n0", "n1", "n2", "n3"})
    c.tick({"n0", "n1", "n2"})  # Ray: n3 is dead; its peers may still be failing on their own
    assert told == []
    clock.t += LivenessPolicy().stranded_after_s
    c.tick({"n0", "n1", "n2"})
    c.tick({"n0", "n1", "n2"})
    assert sorted(told) == [("10.0.0.0", 40000, 1), ("10.0.0.1", 40001, 1), ("10.0.0.2", 40002, 1)]  # once each
    assert sorted(e[2]["worker_id"] for e in events if e[0] == "worker_stranded") == ["w0", "w1", "w2"]
    for i, dc in enumerate(["dc-a", "dc-a", "dc-b"]):  # their next processes rejoin: re-formed without w3
        c.join(_request(i, dc, 7), known_epoch=1, poll_s=0)
    assert c.epoch.number == 2 and [m.worker_id for m in c.epoch.members] == ["w0", "w1", "w2"]


def test_members_that_rejoined_on_their_own_are_not_told_to_stop_when_ray_reports_the_node_dead():
    told: list[tuple[str, int, int]] = []
    clock = _Clock()
    c = _coordinator(clock, told)
    c.join(_request(0, "dc-a", 7), known_epoch=1, poll_s=0)  # a collective failed: w0 rejoins at once
    for _ in range(3):
        c.tick({"n0", "n1", "n2"})
        clock.t += LivenessPolicy().stranded_after_s
    assert told == []  # the re-formation is under way; the usual rules (probe, grace, abort_after_s) apply


def test_concurrent_probes_of_one_member_count_one_miss_and_a_worker_that_calls_is_alive_again():
    # Every rejoining survivor probes the silent member at once: their probes timing out together on one slow second
    # counted as "twice in a row", and the live member was taken for gone for good.
    started = threading.Barrier(3, timeout=5)
    calls = []

    def slow_miss(address, port):
        calls.append(address)
        time.sleep(0.2)
        return Probe.UNREACHABLE

    t = Probes(probe_fn=slow_miss)

    def check():
        started.wait()
        t.probe_each([("w3", "h3", 9003)])

    threads = [threading.Thread(target=check) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(5)
    assert t.seen("w3") == (Probe.UNREACHABLE, 1) and len(calls) == 1  # one probe in flight at a time: one miss
    assert _dead_after(t, [("w3", "h3", 9003)]) == {"w3"}  # a second miss, after the first: twice in a row
    t.revive("w3")  # it called the coordinator: alive after all
    assert t.seen("w3") == (None, 0) and _dead_after(t, [("w3", "h3", 9003)]) == set()  # its count starts again
