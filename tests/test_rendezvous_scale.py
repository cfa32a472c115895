"""What keeps the rendezvous' cost per call flat as a job grows (``bench scale`` at 3,072 ranks): joins are not held
beyond the coordinator's threads, an assignment does not list every rank, a waiting worker's repeated call is not a
new decision, wait reasons that only count up are not one event per join, heartbeat batches widen with the epoch."""

from __future__ import annotations

import pickle
import threading

import pytest

import meridian.service.runner.coordinator as coordinator
from meridian.service.runner.coordinator import (
    JOIN_CALLS_PER_S,
    RETRY_AFTER_S,
    WAITING_EVENT_EVERY_S,
    Coordinator,
)
from meridian.service.runner.membership import Epoch, Member
from meridian.workers.contracts.events import EventKind
from meridian.workers.contracts.rendezvous import Assignment, JoinRequest, Waiting, runs, spans
from meridian.workers.elastic.protocol import BEATS_EVERY_MAX_S, BEATS_EVERY_S, beats_every_s


def request(i: int, dc: str, node: str | None = None, step: int = 0) -> JoinRequest:
    return JoinRequest(worker_id=f"w{i}", datacenter=dc, node_id=node or f"n{i // 8}", address="127.0.0.1",
                       port=20000 + i, last_step=step)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def formed(n: int, *, max_waiters: int = 0, events: list | None = None, clock: Clock | None = None) -> Coordinator:
    """A coordinator whose first epoch of ``n`` ranks (two datacenters, 8 per node) has formed."""
    c = Coordinator(planned_workers=n, min_workers=1, dc_order=("dc-a", "dc-b"), grace_s=30,
                    on_event=lambda *e: events.append(e) if events is not None else None,
                    max_waiters=max_waiters, clock=clock or Clock())
    for i in range(n):
        c.join(request(i, "dc-a" if i < n // 2 else "dc-b"), poll_s=0.0)
    assert c.epoch is not None and len(c.epoch.members) == n
    return c


def test_a_join_that_cannot_be_answered_yet_is_not_held_and_is_told_a_call_back_delay_sized_to_the_job():
    planned = 4 * int(JOIN_CALLS_PER_S)
    c = Coordinator(planned_workers=planned, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: None,
                    max_waiters=0)
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.setdefault("reply", c.join(request(0, "dc-a"), poll_s=3600.0)))
    t.start()
    t.join(60)  # held, it would wait its hour-long poll
    assert not t.is_alive()
    reply = out["reply"]
    assert isinstance(reply, Waiting) and f"1 of {planned}" in reply.reason
    assert reply.retry_after_s == pytest.approx(planned / JOIN_CALLS_PER_S) and reply.retry_after_s > RETRY_AFTER_S
    assert "w0" in c.state.waiting and c._waiters == 0  # registered, and no thread waits for it
    small = Coordinator(planned_workers=4, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: None, max_waiters=0)
    assert small.retry_after_s == RETRY_AFTER_S  # a small job calls back as before


def test_an_assignment_s_size_does_not_grow_with_the_world_and_it_still_names_every_rank_s_datacenter():
    sizes = {}
    for n in (64, 1024):
        c = formed(n)
        a = c.join(request(3, "dc-a"), poll_s=0.0)  # its next call: the epoch formed since
        assert isinstance(a, Assignment) and a.world_size == n
        assert a.datacenters == c.epoch.datacenters and a.newcomer_ranks == tuple(range(n)) and a.is_newcomer
        wire = pickle.dumps(a)
        back = pickle.loads(wire)
        assert back == a and back.datacenters[n - 1] == "dc-b" and back.datacenters[0] == "dc-a"
        sizes[n] = len(wire)
    assert sizes[1024] - sizes[64] < 1024 - 64  # not a byte per added rank, let alone an entry


def test_an_expanded_layout_read_on_one_side_does_not_travel():
    a = Assignment.of(epoch=1, rank=0, world_size=512, datacenters=["dc-a"] * 256 + ["dc-b"] * 256,
                      newcomer_ranks=range(512), master_addr="h", master_port=1, resume_step=0, from_checkpoint=False)
    before = len(pickle.dumps(a))
    assert len(a.datacenters) == 512 and len(a.newcomer_ranks) == 512  # read here: cached on this side
    assert len(pickle.dumps(a)) == before


def test_runs_and_spans_encode_layouts_losslessly():
    assert runs(["a", "a", "b", "a"]) == (("a", 2), ("b", 1), ("a", 1))
    assert spans([5, 0, 1, 2, 7, 6, 1]) == ((0, 3), (5, 8))
    a = Assignment.of(epoch=2, rank=4, world_size=6, datacenters=("a", "a", "b", "b", "b", "a"),
                      newcomer_ranks=(1, 4, 5), master_addr="h", master_port=1, resume_step=3, from_checkpoint=False)
    assert a.datacenters == ("a", "a", "b", "b", "b", "a") and a.newcomer_ranks == (1, 4, 5) and a.is_newcomer
    assert not Assignment.of(epoch=2, rank=0, world_size=6, datacenters=a.datacenters, newcomer_ranks=(1, 4, 5),
                             master_addr="h", master_port=1, resume_step=3, from_checkpoint=False).is_newcomer


def test_a_waiting_worker_calling_again_unchanged_is_not_a_new_decision(monkeypatch):
    c = Coordinator(planned_workers=3, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: None, max_waiters=0)
    calls = []
    real = coordinator.decide
    monkeypatch.setattr(coordinator, "decide", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    c.join(request(0, "dc-a"), poll_s=0.0)
    assert len(calls) == 1
    for _ in range(5):
        assert isinstance(c.join(request(0, "dc-a"), poll_s=0.0), Waiting)
    assert len(calls) == 1  # the tick decides what time alone changes
    c.join(request(0, "dc-a", step=4), poll_s=0.0)  # it says something new: decided again
    assert len(calls) == 2
    c.join(request(1, "dc-a"), poll_s=0.0)
    assert isinstance(c.join(request(2, "dc-a"), poll_s=0.0), Assignment)  # the last one still forms the epoch


def test_a_first_epoch_s_joins_make_one_waiting_event_and_the_tick_reports_the_latest_count_later():
    events: list = []
    clock = Clock()
    n = 40
    c = Coordinator(planned_workers=n, min_workers=1, dc_order=("dc-a",), on_event=lambda *e: events.append(e),
                    max_waiters=0, clock=clock)
    for i in range(n - 1):
        c.join(request(i, "dc-a"), poll_s=0.0)
    waiting = [e[1] for e in events if e[0] == EventKind.WAITING]
    assert waiting == [f"1 of {n} workers have started"]  # before: one event per join
    clock.now += WAITING_EVENT_EVERY_S
    c.tick({f"n{i // 8}" for i in range(n)})
    assert [e[1] for e in events if e[0] == EventKind.WAITING][-1] == f"{n - 1} of {n} workers have started"
    c.join(request(n - 1, "dc-a"), poll_s=0.0)
    assert c.epoch is not None and c.wait_reason == ""


def test_a_reason_of_another_kind_is_reported_at_once():
    events: list = []
    clock = Clock()
    c = formed(16, events=events, clock=clock)
    events.clear()
    c.tick({f"n{i}" for i in range(2)})
    c.join(request(0, "dc-a", step=3), known_epoch=1, poll_s=0.0)  # a member rejoins: a re-formation waits
    said = [e[1] for e in events if e[0] == EventKind.WAITING]
    assert said and "reachable workers are back" in said[-1]


def test_a_re_formation_forms_when_the_last_reachable_member_is_back_and_not_before():
    clock = Clock()
    c = formed(32, clock=clock)
    lost = "n3"  # the last node of dc-b: ranks 24-31
    alive = {f"n{i}" for i in range(4)} - {lost}
    c.tick(alive)
    survivors = [i for i in range(32) if f"n{i // 8}" != lost]
    for i in survivors[:-1]:
        r = c.join(request(i, "dc-a" if i < 16 else "dc-b", step=5), known_epoch=1, poll_s=0.0)
        assert isinstance(r, Waiting) and c.epoch.number == 1
    # The rejoined, kept as they came, are what a scan would find.
    assert c._back == set(c.state.waiting) & c.epoch.ids and len(c._back) == len(survivors) - 1 and not c._new
    a = c.join(request(survivors[-1], "dc-b", step=5), known_epoch=1, poll_s=0.0)
    assert isinstance(a, Assignment) and a.epoch == 2 and a.world_size == len(survivors) and a.resume_step == 5


def test_an_epoch_finds_its_unreachable_members_by_node_and_by_verdict():
    members = tuple(Member(worker_id=f"w{i}", datacenter="dc-a", node_id=f"n{i // 2}", address="h", joined_at=i)
                    for i in range(6))
    e = Epoch(1, members, resume_step=0)
    assert e.unreachable({"n0", "n1", "n2"}, set()) == set()
    assert e.unreachable({"n0", "n2"}, {"w0", "stranger"}) == {"w0", "w2", "w3"}


def test_heartbeat_batches_widen_with_the_epoch_and_stay_under_the_stall_floor():
    assert beats_every_s(8) == BEATS_EVERY_S
    assert BEATS_EVERY_S < beats_every_s(1024) <= beats_every_s(2048) <= BEATS_EVERY_MAX_S
    assert beats_every_s(10**6) == BEATS_EVERY_MAX_S


def test_a_training_process_s_sink_batches_as_long_as_its_epoch_s_size_says():
    from meridian.workers.elastic.child import PipeSink

    class Client:
        def __init__(self) -> None:
            self.told: list = []

        def tell(self, *msg: object) -> None:
            self.told.append(msg)

    sink = PipeSink(Client())  # type: ignore[arg-type]
    try:
        assert sink._every_s == BEATS_EVERY_S
        sink.pace(4096)
        assert sink._every_s == beats_every_s(4096) > BEATS_EVERY_S
    finally:
        sink.close()
