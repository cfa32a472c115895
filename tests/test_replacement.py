"""The runner's choice of where a replacement worker starts after a loss, without Ray."""

from __future__ import annotations

from meridian.service.runner.membership import Member
from meridian.service.runner.replacement import replacement_datacenter

PLANNED = {"dc-a": 2, "dc-b": 2}


def member(wid: str, dc: str, node: str) -> Member:
    return Member(worker_id=wid, datacenter=dc, node_id=node, address="127.0.0.1", joined_at=0.0)


MEMBERS = [member("a0", "dc-a", "na0"), member("a1", "dc-a", "na1"), member("b0", "dc-b", "nb0"),
           member("b1", "dc-b", "nb1")]
ALL_ALIVE = {"na0", "na1", "nb0", "nb1"}


def test_a_full_membership_needs_nothing():
    assert replacement_datacenter(PLANNED, MEMBERS, alive_nodes=ALL_ALIVE, with_room={"dc-a", "dc-b"}) is None


def test_a_datacenter_short_of_its_plan_gets_a_worker_once_it_has_room():
    alive = ALL_ALIVE - {"nb1"}
    assert replacement_datacenter(PLANNED, MEMBERS, alive_nodes=alive, with_room={"dc-b"}) == "dc-b"
    assert replacement_datacenter(PLANNED, MEMBERS, alive_nodes=alive, with_room={"dc-a"}) is None  # no room in dc-b


def test_a_started_replacement_counts_until_it_joins():
    alive = ALL_ALIVE - {"nb1"}
    assert replacement_datacenter(PLANNED, MEMBERS, alive_nodes=alive, pending=["dc-b"], with_room={"dc-b"}) is None


def test_nothing_starts_while_a_newcomer_waits_to_join():
    alive = ALL_ALIVE - {"nb1"}
    assert replacement_datacenter(PLANNED, MEMBERS, alive_nodes=alive, with_room={"dc-b"},
                                  newcomer_waiting=True) is None


def test_one_replacement_at_a_time_in_plan_order():
    alive = {"na0", "nb0"}
    assert replacement_datacenter(PLANNED, MEMBERS, alive_nodes=alive, with_room={"dc-a", "dc-b"}) == "dc-a"
    assert replacement_datacenter({"dc-b": 2, "dc-a": 2}, MEMBERS, alive_nodes=alive,
                                  with_room={"dc-a", "dc-b"}) == "dc-b"
