"""The state-exchange plan: every rank ends with every value and its own ranges' moments, each exactly once,
and only what a datacenter lacks crosses between datacenters, once.

Pure (no processes): offers are built for sharded layouts the way the hierarchical engine shards (each rank of a
DC owns a contiguous share of every parameter), and the plan is replayed element by element. The exchange itself,
over gloo with real engines, is tested in test_replica_state.
"""

from __future__ import annotations

import pytest

from meridian.workers.state.exchange_plan import ExchangePlan, Offer, plan_exchange
from meridian.workers.state.replica_state import IncompleteState

MOMENTS = ("exp_avg", "exp_avg_sq")
NUMELS = {"embed": 1000, "w1": 777, "b1": 13, "gain": 1}


def shares(numel: int, k: int) -> list[tuple[int, int]]:
    cut = [numel * i // k for i in range(k + 1)]
    return list(zip(cut, cut[1:], strict=False))


def owned(i: int, k: int) -> list[tuple[str, int, int]]:
    return [(n, *shares(numel, k)[i]) for n, numel in NUMELS.items() if shares(numel, k)[i][0] < shares(numel, k)[i][1]]


def offer(dc: str, held: tuple[int, int] | None, needs: tuple[int, int] | None, adam_step: int = 5) -> Offer:
    """``held``/``needs``: (share index, shares in the DC) of the old/new layout; ``None``: no snapshot /
    everything (a replicated optimizer)."""
    pieces = None if held is None else {"step": 7, "adam_step": adam_step, "outer": None, "pieces": [
        (n, a, b, MOMENTS if adam_step else ()) for n, a, b in owned(*held)]}  # fmt: skip
    return Offer(dc, pieces, None if needs is None else owned(*needs))


def replay(plan: ExchangePlan, offers: list[Offer]) -> None:
    """Apply the plan element by element: each round's sender must hold what it sends (from its snapshot or an
    earlier round); every rank ends with each value and each needed moment, received or held, exactly once."""
    values = [{(n, e) for n, a, b, _ in (o.held or {}).get("pieces", ()) for e in range(a, b)} for o in offers]
    moments = [{(n, e) for n, a, b, ms in (o.held or {}).get("pieces", ()) if ms for e in range(a, b)} for o in offers]
    got_v: list[list[tuple[str, int]]] = [[] for _ in offers]
    got_m: list[list[tuple[str, int]]] = [[] for _ in offers]
    for moves in plan.rounds:
        arrived = []
        for (src, dst), ms in moves.items():
            for m in ms:
                span = [(m.name, e) for e in range(m.start, m.stop)]
                assert set(span) <= values[src], (src, m)
                if m.moments:
                    assert set(span) <= moments[src], (src, m)
                got_v[dst] += span
                got_m[dst] += span if m.moments else []
                arrived.append((dst, span, bool(m.moments)))
        for dst, span, with_moments in arrived:  # relayed only in a later round
            values[dst] |= set(span)
            if with_moments:
                moments[dst] |= set(span)
    every = [(n, e) for n, k in NUMELS.items() for e in range(k)]
    for r in range(len(offers)):
        assert sorted(got_v[r]) == sorted(every), f"rank {r}: values not each exactly once"
        need = [(n, e) for n, a, b in plan.needs[r] for e in range(a, b)]
        if plan.adam_step:
            assert set(got_m[r]) >= set(need) and len(got_m[r]) == len(set(got_m[r])), f"rank {r}: moments"


def elements(plan: ExchangePlan, *, cross_dc_only: bool) -> int:
    return plan.sent_bytes(cross_dc_only=cross_dc_only) // 4


def test_losing_a_rank_of_a_datacenter_moves_its_share_across_once_and_relays_it_inside():
    # 2 DCs x 4 ranks; dc-b's rank 3 died; the epoch re-forms as 4 + 3
    offers = [offer("a", (i, 4), (i, 4)) for i in range(4)] + [offer("b", (i, 4), (i, 3)) for i in range(3)]
    plan = plan_exchange(offers, NUMELS)
    replay(plan, offers)
    lost = sum(b - a for _, a, b in owned(3, 4))
    # the dead rank's share crosses once: its values and moments, to the dc-b rank that owns them now
    assert elements(plan, cross_dc_only=True) == 3 * lost
    assert all(plan.dcs[s] == "a" and plan.dcs[d] == "b" for rnd in plan.rounds for s, d in rnd if plan.dcs[s] != plan.dcs[d])
    assert len(plan.rounds) == 2  # the other two dc-b ranks get those values from inside dc-b
    assert all(plan.dcs[s] == plan.dcs[d] == "b" for s, d in plan.rounds[1])
    # dc-a's ranks keep their shares: each takes only the other dc-a ranks' values, inside dc-a
    for r in range(4):
        assert all(plan.dcs[s] == "a" for rnd in plan.rounds for s, d in rnd if d == r)
    # against gathering every shard on every rank: each of 7 ranks received the other 6's shards
    whole = sum(NUMELS.values())
    gather_all = 6 * (2 * 3 * whole - 3 * lost)
    assert elements(plan, cross_dc_only=False) < gather_all / 3


def test_a_datacenter_that_keeps_its_layout_takes_nothing_across():
    offers = [offer("a", (0, 2), (0, 2)), offer("a", (1, 2), (1, 2)), offer("b", (0, 2), (0, 1))]
    plan = plan_exchange(offers, NUMELS)
    replay(plan, offers)
    assert len(plan.rounds) == 1  # one rank fetches for a DC of one: nothing to relay
    into_a = [m for rnd in plan.rounds for (s, d), m in rnd.items() if d < 2 and s != d]
    assert into_a and all(s < 2 for rnd in plan.rounds for (s, d) in rnd if d < 2)


def test_a_newcomer_datacenter_gets_the_state_across_once_and_spread_over_the_senders():
    offers = [offer("a", (0, 2), (0, 2)), offer("a", (1, 2), (1, 2)), offer("b", None, (0, 2)), offer("b", None, (1, 2))]
    plan = plan_exchange(offers, NUMELS)
    replay(plan, offers)
    whole = sum(NUMELS.values())
    assert elements(plan, cross_dc_only=True) == 3 * whole  # one replica's values and moments, once
    sent_across = {s: sum(m.numel for (s2, d), ms in plan.rounds[0].items() if s2 == s and d >= 2 for m in ms)
                   for s in (0, 1)}  # fmt: skip
    assert min(sent_across.values()) > 0.3 * whole  # both dc-a ranks send


def test_a_replicated_optimizer_sends_nothing_between_survivors():
    offers = [Offer("a", offer("a", (0, 1), None).held, None), Offer("b", offer("b", (0, 1), None).held, None)]
    plan = plan_exchange(offers, NUMELS)
    replay(plan, offers)
    assert elements(plan, cross_dc_only=False) == 0


def test_before_the_first_optimizer_step_only_values_move():
    offers = [offer("a", (0, 2), (0, 1), adam_step=0), offer("b", (1, 2), (0, 1), adam_step=0)]
    plan = plan_exchange(offers, NUMELS)
    replay(plan, offers)
    assert all(not m.moments for rnd in plan.rounds for ms in rnd.values() for m in ms)


@pytest.mark.parametrize("lost", [(1, 3), (0, 2)], ids=["same-share-both-dcs", "share-0"])
def test_state_nobody_holds_is_refused_by_element_and_parameter(lost):
    layout = [("a", (0, 2)), ("a", (1, 2)), ("b", (0, 2)), ("b", (1, 2))]
    offers = [offer(dc, held, (0, 1)) for r, (dc, held) in enumerate(layout) if r not in lost]
    with pytest.raises(IncompleteState, match=r"no surviving rank holds element \d+ of parameter 'embed'"):
        plan_exchange(offers, NUMELS)
    with pytest.raises(IncompleteState, match="no rank holds a snapshot"):
        plan_exchange([offer("a", None, (0, 1))], NUMELS)


def test_moments_missing_where_they_are_needed_are_refused():
    values_only = Offer("a", {"step": 7, "adam_step": 5, "outer": None,
                              "pieces": [(n, 0, k, ()) for n, k in NUMELS.items()]}, owned(0, 1))  # fmt: skip
    with pytest.raises(IncompleteState, match="optimizer state of element 0"):
        plan_exchange([values_only], NUMELS)


def test_snapshots_of_different_steps_or_unknown_parameters_are_errors():
    a, b = offer("a", (0, 2), (0, 2)), offer("a", (1, 2), (1, 2))
    other = Offer("a", {**b.held, "step": 8}, b.needs)
    with pytest.raises(ValueError, match="different steps"):
        plan_exchange([a, other], NUMELS)
    with pytest.raises(ValueError, match="does not have"):
        plan_exchange([a, b], {k: v for k, v in NUMELS.items() if k != "embed"})


def test_before_any_moments_exist_what_a_datacenter_lacks_is_fetched_by_its_ranks_in_turn():
    offers = [offer("a", (0, 2), (0, 2), adam_step=0), offer("a", (1, 2), (1, 2), adam_step=0),
              offer("b", None, (0, 2)), offer("b", None, (1, 2))]  # fmt: skip
    plan = plan_exchange(offers, NUMELS)
    replay(plan, offers)
    whole = sum(NUMELS.values())
    fetched = {d: sum(m.numel for (s, d2), ms in plan.rounds[0].items() if d2 == d and s < 2 for m in ms) for d in (2, 3)}
    assert sum(fetched.values()) == whole and min(fetched.values()) > 0.3 * whole, fetched
