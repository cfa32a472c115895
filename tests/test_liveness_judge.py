"""The liveness judge against tables of observations: every rule, its order, and what the controller does about
each verdict (pure: no Ray, no sockets, no clock)."""

from __future__ import annotations

import pytest

from meridian.service.runner.controller.decide import (
    LeaveBehind,
    NameRanks,
    RanksJudged,
    StopStuck,
    decide,
    liveness_actions,
)
from meridian.service.runner.controller.state import Cancelled, Ending, Training
from meridian.service.runner.liveness.judge import (
    Beat,
    Cause,
    Liveness,
    LivenessPolicy,
    Probe,
    RankSeen,
    Seen,
    judge,
)
from meridian.service.runner.liveness.watch import LivenessWatch

POLICY = LivenessPolicy(abort_after_s=10.0, stranded_after_s=1.0, newcomers_abort_after_s=60.0, stall_factor=5.0,
                        stall_floor_s=2.0, slow_factor=2.0, slow_min_s=0.05, slow_min_beats=3)


def rank(i: int, **kw) -> RankSeen:
    return RankSeen(worker_id=f"w{i}", rank=i, node_id=f"node-{i}", datacenter="dc-a" if i < 2 else "dc-b",
                    **{"probe_port": 40000 + i, **kw})


def seen(*ranks: RankSeen, now: float = 100.0, **kw) -> Seen:
    return Seen(now=now, epoch=3, ranks=ranks, **kw)


def verdicts(s: Seen) -> list[tuple[str, Liveness, Cause]]:
    return [(v.worker_id, v.liveness, v.cause) for v in judge(s, POLICY)]


A, D, ST, SL = Liveness.ALIVE, Liveness.DEAD, Liveness.STUCK, Liveness.SLOW


# -- membership evidence: Ray's node state, the liveness port, the rendezvous ------------------------------------
MEMBERSHIP_TABLE = [
    # (what is known about w0 while w1 rejoined ``since`` seconds ago (None: nobody did), expected w0 verdict)
    ({}, None, (A, Cause.TRAINING)),
    ({"node_alive": False}, None, (D, Cause.NODE_DEAD)),
    ({"node_alive": False, "rejoined": True}, 0.0, (D, Cause.NODE_DEAD)),  # Ray's word comes first
    ({"probe": Probe.GONE}, 0.0, (D, Cause.PROCESS_GONE)),
    ({"probe": Probe.UNREACHABLE, "misses": 1}, 0.0, (A, Cause.TRAINING)),  # one miss is a slow second
    ({"probe": Probe.UNREACHABLE, "misses": 2}, 0.0, (D, Cause.HOST_UNREACHABLE)),
    ({"probe": Probe.ALIVE}, 9.9, (A, Cause.TRAINING)),  # it may be on its way back
    ({"probe": Probe.ALIVE}, 10.0, (ST, Cause.NOT_REJOINED)),
    ({"probe": Probe.ALIVE, "probe_port": 0}, 10.0, (A, Cause.TRAINING)),  # no port: nothing to tell it
    ({"rejoined": True}, 30.0, (A, Cause.REJOINED)),
    ({"rejoined": True, "probe": Probe.GONE}, 0.0, (D, Cause.PROCESS_GONE)),  # a stale answer until it calls
]


@pytest.mark.parametrize(("w0", "since", "expected"), MEMBERSHIP_TABLE)
def test_a_member_is_judged_from_ray_its_port_and_the_rendezvous(w0, since, expected):
    s = seen(rank(0, **w0), rank(1, rejoined=True), reform_since=None if since is None else 100.0 - since)
    assert verdicts(s)[0][1:] == expected
    assert verdicts(s)[1][1:] == (A, Cause.REJOINED)


def test_stranded_members_of_a_dead_node_are_stuck_after_a_second_unless_someone_rejoined():
    ranks = (rank(0), rank(1), rank(2, node_alive=False))
    assert verdicts(seen(*ranks, node_dead_since=99.5)) == [("w0", A, Cause.TRAINING), ("w1", A, Cause.TRAINING),
                                                            ("w2", D, Cause.NODE_DEAD)]  # fmt: skip
    assert verdicts(seen(*ranks, node_dead_since=99.0)) == [("w0", ST, Cause.STRANDED), ("w1", ST, Cause.STRANDED),
                                                            ("w2", D, Cause.NODE_DEAD)]  # fmt: skip
    rejoined = (rank(0, rejoined=True), rank(1), rank(2, node_alive=False))  # a re-formation is under way
    assert [v[1] for v in verdicts(seen(*rejoined, node_dead_since=90.0, reform_since=99.9))] == [A, A, D]
    assert [v[1] for v in verdicts(seen(*ranks, node_dead_since=90.0, finished=True))] == [A, A, D]
    reason = judge(seen(*ranks, node_dead_since=99.0), POLICY)[0].reason
    assert "node node-2 in dc-b dead" in reason and "power or network" in reason


def test_members_are_stuck_when_newcomers_waited_a_minute_for_a_step_boundary():
    newcomer = RankSeen(worker_id="w9", rank=None, node_id="node-9", datacenter="dc-b", probe_port=40009)
    assert [v[1] for v in verdicts(seen(rank(0), newcomer, newcomers_since=40.1))] == [A, A]
    out = judge(seen(rank(0), newcomer, newcomers_since=40.0), POLICY)
    assert [(v.liveness, v.cause) for v in out] == [(ST, Cause.NO_STEP_BOUNDARY), (A, Cause.REJOINED)]
    assert "new workers waited 60 s" in out[0].reason


def test_a_waiting_worker_is_dead_only_by_its_port_never_by_a_node_report():
    newcomer = RankSeen(worker_id="w9", rank=None, node_id="node-new", datacenter="dc-b", probe_port=40009)
    assert verdicts(seen(newcomer)) == [("w9", A, Cause.REJOINED)]
    gone = RankSeen(worker_id="w9", rank=None, node_id="node-new", datacenter="dc-b", probe_port=1, probe=Probe.GONE)
    assert verdicts(seen(gone)) == [("w9", D, Cause.PROCESS_GONE)]


# -- heartbeats: stuck (silent and behind) and slow --------------------------------------------------------------
def beat(step, at, computed=None, compute=(0.5, 0.5, 0.5)):
    return Beat(step=step, computed=step if computed is None else computed, at=at, compute_s=compute)


HEARTBEAT_TABLE = [
    # (beats of ranks 0..2 at beats_at=100 with a median step of 1 s (threshold 5 s), expected verdicts)
    ((beat(8, 99.5), beat(8, 99.5), beat(8, 99.5)), [A, A, A]),
    ((beat(8, 99.5), beat(7, 94.9), beat(8, 99.5)), [A, ST, A]),  # silent 5.1 s and behind
    ((beat(8, 95.5), beat(7, 95.1, computed=8), beat(8, 99.5)), [A, A, A]),  # silent 4.9 s: under the threshold
    ((beat(8, 90.0, computed=9), beat(8, 90.0), beat(8, 90.0, computed=9)), [A, ST, A]),  # the one that did not compute
    ((beat(8, 90.0), beat(8, 90.0), beat(8, 90.0)), [ST, ST, ST]),  # all equally far: the collective hangs
    ((beat(8, 99.5), beat(8, 99.5, compute=(1.2, 1.1, 1.3)), beat(8, 99.5)), [A, SL, A]),
    ((beat(8, 99.5), beat(8, 99.5, compute=(0.9, 1.0, 0.9)), beat(8, 99.5)), [A, A, A]),  # 1.8x: not slow
    ((beat(8, 99.5), beat(8, 99.5, compute=(1.2, 1.1)), beat(8, 99.5)), [A, A, A]),  # too few beats to say
    ((beat(8, 99.5, compute=(0.001,) * 3), beat(8, 99.5, compute=(0.01,) * 3), beat(8, 99.5, compute=(0.001,) * 3)),
     [A, A, A]),  # 10x, but 9 ms: jitter
    ((beat(8, 99.5), beat(7, 90.0, compute=(1.2, 1.1, 1.3)), beat(8, 99.5)), [A, ST, A]),  # stuck wins over slow
]


@pytest.mark.parametrize(("beats", "expected"), HEARTBEAT_TABLE)
def test_heartbeats_say_stuck_or_slow(beats, expected):
    s = seen(*(rank(i, beat=b) for i, b in enumerate(beats)), beats_at=100.0, recent_step_s=(1.0, 1.0, 1.0))
    assert [v[1] for v in verdicts(s)] == expected


def test_a_silent_verdict_carries_the_stall_figures_and_a_slow_one_its_medians():
    s = seen(rank(0, beat=beat(8, 99.5)), rank(1, beat=beat(7, 80.0)),
             rank(2, beat=beat(8, 99.5, compute=(1.5, 1.6, 1.4))), beats_at=100.0, recent_step_s=(1.0, 1.2, 0.8))
    v0, v1, v2 = judge(s, POLICY)
    assert v1.stall is not None and (v1.stall.rank, v1.stall.step, v1.stall.silent_s) == (1, 7, 20.0)
    assert (v1.stall.threshold_s, v1.stall.node_id, v1.stall.datacenter) == (5.0, "node-1", "dc-a")
    assert v1.where + " " + v1.reason == ("rank 1 in dc-a on node node-1 has not finished a step for 20.0 s (> 5.0 s "
                                          "= threshold from a median step of 1.00 s); it last finished step 7")
    assert v2.liveness is SL and (v2.compute_s, v2.peers_compute_s) == (1.5, 0.5) and "3.0x" in v2.reason


def test_nothing_is_judged_from_heartbeats_while_the_ranks_are_idle_or_before_a_step_time_is_known():
    ranks = (rank(0, beat=beat(8, 50.0)), rank(1, beat=beat(2, 10.0, compute=(9.0,) * 3)))
    assert [v[1] for v in verdicts(seen(*ranks, beats_at=100.0, recent_step_s=(1.0,), idle=True))] == [A, A]
    assert [v[1] for v in verdicts(seen(*ranks, beats_at=100.0, recent_step_s=()))] == [A, A]
    assert [v[1] for v in verdicts(seen(*ranks, beats_at=100.0, recent_step_s=(1.0,)))] == [A, ST]


def test_the_policy_rejects_nonsense_naming_the_field():
    for field, value in (("stall_factor", 1.0), ("slow_factor", 0.5), ("unreachable_times", 0),
                         ("abort_after_s", -1.0), ("slow_min_beats", 0)):
        with pytest.raises(ValueError, match=field):
            LivenessPolicy(**{field: value})


# -- each verdict once, and what the controller does about it ----------------------------------------------------
def test_the_watch_hands_each_verdict_on_once_and_a_worker_that_calls_can_die_again():
    w = LivenessWatch()
    dead = seen(rank(0, probe=Probe.GONE), rank(1, beat=beat(7, 80.0)), rank(2, beat=beat(8, 99.5)),
                beats_at=100.0, recent_step_s=(1.0,))
    first = w.new(judge(dead, POLICY))
    assert [(v.worker_id, v.liveness) for v in first] == [("w0", D), ("w1", ST)]
    assert w.new(judge(dead, POLICY)) == () and [s.rank for s in w.stalls()] == [1]
    later = seen(rank(0, probe=Probe.GONE), rank(1, beat=beat(9, 80.0)), rank(2, beat=beat(10, 99.5)),
                 beats_at=100.0, recent_step_s=(1.0,))
    assert [(v.worker_id, v.step) for v in w.new(judge(later, POLICY))] == [("w1", 9)]  # silent again, at a new step
    w.forget("w0")  # it called the rendezvous: alive, and its next death is news
    assert [v.worker_id for v in w.new(judge(dead, POLICY))] == ["w0"]


def test_the_controller_leaves_the_dead_stops_the_stuck_and_names_the_rest_only_while_training():
    s = seen(rank(0, node_alive=False), rank(1, probe=Probe.ALIVE, beat=beat(5, 99.0)),
             rank(2, rejoined=True, beat=beat(8, 99.5)), rank(3, beat=beat(7, 80.0)), reform_since=80.0,
             beats_at=100.0, recent_step_s=(1.0,))
    vs = judge(s, POLICY)
    assert [(v.liveness, v.cause) for v in vs] == [(D, Cause.NODE_DEAD), (ST, Cause.NOT_REJOINED),
                                                   (A, Cause.REJOINED), (ST, Cause.NOT_REJOINED)]  # fmt: skip
    actions = liveness_actions(vs)
    assert [type(a) for a in actions] == [LeaveBehind, StopStuck]
    assert [v.worker_id for v in actions[0].verdicts] == ["w0"]
    assert [v.worker_id for v in actions[1].verdicts] == ["w1", "w3"]
    named = liveness_actions(judge(seen(rank(0, beat=beat(8, 99.5)), rank(1, beat=beat(7, 80.0)),
                                        rank(2, beat=beat(8, 99.5, compute=(2.0,) * 3)),
                                        beats_at=100.0, recent_step_s=(1.0,)), POLICY))  # fmt: skip
    assert [type(a) for a in named] == [NameRanks] and [v.cause for v in named[0].verdicts] == [Cause.SILENT,
                                                                                                  Cause.SLOW_STEPS]
    state = Training()
    assert decide(state, RanksJudged(vs)) == (state, actions)
    ending = Ending(outcome=Cancelled())
    assert decide(ending, RanksJudged(vs)) == (ending, ())  # a job being stopped stops nobody for liveness
