"""The WAN emulator's cost model in numbers, and its shared link state inside one process.

Timing assertions: the emulator must never be faster than the model, so lower bounds are the model itself;
upper bounds leave room for a loaded 2-core machine (``late``).
"""

from __future__ import annotations

import os
import struct
import threading

import pytest
from wan_helpers import AAB, AABB, AB, ABAB, ABC, MB, WAN
from wan_helpers import new_key as _key

from meridian.workers.wan.collectives import (
    Algorithm,
    WanCounter,
    WanEmulator,
    cleanup,
    collective_cost,
    p2p_cost,
)
from meridian.workers.wan.link import SharedLink

# --------------------------------------------------------------------------------------------- cost model


def test_exchange_two_dcs_sends_the_tensor_once_in_one_step() -> None:
    c = collective_cost(Algorithm.EXCHANGE, [0, 1], AB, 4 * MB)
    assert (c.algorithm, c.rounds) == (Algorithm.DIRECT, 2)  # one step waits a round trip: 2 one-way delays
    assert c.bytes_of(0) == c.bytes_of(1) == 4 * MB
    assert c.link_bytes() == {("dc-a", "dc-b"): 4 * MB, ("dc-b", "dc-a"): 4 * MB}
    assert c.isolated_s(WAN) == pytest.approx(4 * MB / 125e6 + 0.020)


def test_two_rank_all_reduce_is_a_ring_of_two_steps_not_an_exchange() -> None:
    # What dist.all_reduce runs between the two owners of a HAR segment: twice the exchange's latency, the
    # same bytes (half the tensor in each of the two steps).
    ring = collective_cost(Algorithm.RING, [0, 1], AB, 4 * MB)
    exchange = collective_cost(Algorithm.EXCHANGE, [0, 1], AB, 4 * MB)
    assert (ring.rounds, exchange.rounds) == (4, 2)
    assert ring.link_bytes() == exchange.link_bytes() == {("dc-a", "dc-b"): 4 * MB, ("dc-b", "dc-a"): 4 * MB}
    assert ring.isolated_s(WAN) - exchange.isolated_s(WAN) == pytest.approx(WAN.one_way_s * 2)


def test_ring_all_gather_sends_every_other_payload_in_w_minus_1_steps() -> None:
    c = collective_cost(Algorithm.RING_GATHER, [0, 1, 2], ABC, MB)
    assert c.rounds == 2 * 2
    assert [c.bytes_of(r) for r in range(3)] == [2 * MB] * 3
    two = collective_cost(Algorithm.RING_GATHER, [0, 1], AB, MB)
    assert (two.rounds, two.bytes_of(0)) == (2, MB)


def test_exchange_three_dcs_picks_direct_over_ring() -> None:
    ring = collective_cost(Algorithm.RING, [0, 1, 2], ABC, 3 * MB)
    assert ring.rounds == 8  # 4 steps, each a round trip
    assert [c.wire_bytes for c in ring.charges] == [4 * MB] * 3  # 2(D-1)/D · S on every edge
    assert ring.isolated_s(WAN) == pytest.approx(4 * MB / 125e6 + 0.080)
    c = collective_cost(Algorithm.EXCHANGE, [0, 1, 2], ABC, 3 * MB, WAN)
    assert (c.algorithm, c.rounds) == (Algorithm.DIRECT, 2)
    assert c.bytes_of(0) == 2 * 3 * MB  # (D-1) · S, one S on each of its two outbound links
    assert c.link_bytes()[("dc-a", "dc-c")] == 3 * MB
    assert c.isolated_s(WAN) == pytest.approx(3 * MB / 125e6 + 0.020)


def test_flat_ring_charges_the_crossing_edges() -> None:
    c = collective_cost(Algorithm.RING, range(4), AABB, 8 * MB)
    assert c.rounds == 12  # 6 ring steps, each a round trip
    per_edge = 2 * 3 / 4 * 8 * MB
    assert [c.bytes_of(r) for r in range(4)] == [0, per_edge, 0, per_edge]  # edges 1→2 and 3→0 cross
    assert c.link_bytes() == {("dc-a", "dc-b"): per_edge, ("dc-b", "dc-a"): per_edge}
    assert c.isolated_s(WAN) == pytest.approx(per_edge / 125e6 + 0.120)

    interleaved = collective_cost(Algorithm.RING, range(4), ABAB, 8 * MB)
    assert interleaved.link_bytes() == {("dc-a", "dc-b"): 2 * per_edge, ("dc-b", "dc-a"): 2 * per_edge}

    uneven = collective_cost(Algorithm.RING, range(3), AAB, 3 * MB)
    assert (uneven.rounds, [uneven.bytes_of(r) for r in range(3)]) == (8, [0, 4 * MB, 4 * MB])


def test_groups_inside_one_dc_and_p2p() -> None:
    inside = collective_cost(Algorithm.RING, [2, 3], AABB, 8 * MB)
    assert (inside.rounds, inside.charges, inside.isolated_s(WAN)) == (0, (), 0.0)
    assert not collective_cost(Algorithm.EXCHANGE, [0, 1], AABB, MB).crosses
    p = p2p_cost(1, 3, AABB, 2 * MB)
    assert (p.rounds, p.bytes_of(1), p.bytes_of(3)) == (1, 2 * MB, 0)
    assert p.link_bytes() == {("dc-a", "dc-b"): 2 * MB}
    assert not p2p_cost(0, 1, AABB, MB).crosses


def test_exchange_rejects_groups_it_cannot_model() -> None:
    with pytest.raises(ValueError, match="one rank per datacenter"):
        collective_cost(Algorithm.EXCHANGE, [0, 1, 2], AABB, MB)
    with pytest.raises(ValueError, match="needs the WanConfig"):
        collective_cost(Algorithm.EXCHANGE, [0, 1, 2], ABC, MB)
    with pytest.raises(ValueError, match="p2p_cost"):
        collective_cost(Algorithm.P2P, [0, 1], AB, MB)


# -------------------------------------------------------------------------------------- link state, 1 proc


def test_link_serialises_bookings(tmp_path) -> None:
    link = SharedLink(str(tmp_path / "l"), bytes_per_s=1e6)
    assert link.free_at() == float("-inf")
    assert link.reserve(1000, start=100.0) == pytest.approx(100.001)
    assert link.reserve(2000, start=100.0) == pytest.approx(100.003)  # queued behind the first
    assert link.reserve(1000, start=200.0) == pytest.approx(200.001)  # idle link: starts at once
    again = SharedLink(str(tmp_path / "l"), bytes_per_s=1e6)  # another process's view of the same file
    assert again.free_at() == pytest.approx(200.001)


def test_stale_link_file_is_ignored(tmp_path) -> None:
    path = tmp_path / "l"
    path.write_bytes(bytes(16) + struct.pack("<d", 1e12))  # another boot's id, free "forever"
    assert SharedLink(str(path), 1e6).reserve(1000, start=5.0) == pytest.approx(5.001)


def test_emulator_books_latency_once_per_round_and_agrees_per_collective(tmp_path) -> None:
    key = _key()
    a = WanEmulator(WAN, AB, 0, key=key, directory=str(tmp_path))
    b = WanEmulator(WAN, AB, 1, key=key, directory=str(tmp_path))
    cost = collective_cost(Algorithm.EXCHANGE, [0, 1], AB, 1.25e6)  # 10 ms of bytes
    t = 1000.0
    assert a.book(cost, t) == pytest.approx(t + 0.010 + 0.020)
    assert a.book(cost, t) == pytest.approx(t + 0.020 + 0.020)  # in flight together: latency paid once
    first = a.settle(cost, tag="g", seq=0, start=t + 1)
    assert first == pytest.approx(t + 1.030)
    assert b.settle(cost, tag="g", seq=0, start=t + 1.002) == first  # the peer reads, does not re-book
    assert a.link("dc-a", "dc-b").free_at() == pytest.approx(t + 1.010)
    stale = b.settle(cost, tag="g", seq=0, start=t + 100)  # same seq, far apart: an earlier run's record
    assert stale == pytest.approx(t + 100.030)
    a.close()
    b.close()
    assert cleanup(key, str(tmp_path)) == 3  # two directions and one ledger
    assert os.listdir(tmp_path) == []


def test_a_group_runs_two_collectives_at_once_and_the_third_waits(tmp_path) -> None:
    # Eight small collectives issued together on one group: gloo runs two at a time, so they complete in
    # four waves of one latency each, not all after one latency (chunks are not all concurrent).
    emu = WanEmulator(WAN, AB, 0, key=_key(), directory=str(tmp_path))
    cost = collective_cost(Algorithm.RING, [0, 1], AB, 0.0)
    t = 500.0
    ready = [emu.settle(cost, tag="g", seq=i, start=t) for i in range(8)]
    latency = cost.rounds * WAN.one_way_s
    assert ready == pytest.approx([t + latency * (1 + i // 2) for i in range(8)])
    emu.close()


def test_bytes_of_a_group_in_sequence_queue_behind_each_other(tmp_path) -> None:
    emu = WanEmulator(WAN, AB, 0, key=_key(), directory=str(tmp_path))
    cost = collective_cost(Algorithm.RING, [0, 1], AB, 1.25e6)  # 10 ms of bytes, 40 ms of latency
    t = 700.0
    ready = [emu.settle(cost, tag="g", seq=i, start=t) for i in range(3)]
    assert ready[0] == pytest.approx(t + 0.050)
    assert ready[1] == pytest.approx(t + 0.060)  # in flight with the first: queued on the link's bytes only
    assert ready[2] == pytest.approx(ready[0] + 0.050)  # waits for the first to complete, then pays it all
    emu.close()


def test_threads_of_one_process_queue_on_a_link(tmp_path) -> None:
    link = SharedLink(str(tmp_path / "l"), bytes_per_s=1e6)
    ends: list[float] = []
    threads = [threading.Thread(target=lambda: ends.append(link.reserve(1000, 0.0))) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(ends) == pytest.approx([0.001 * (i + 1) for i in range(8)])


def test_counter_reset_returns_what_it_held() -> None:
    c = WanCounter()
    c.add(100, 150.0)
    c.add(50, 0.0)
    snap = c.reset()
    assert (snap.tensor_bytes, snap.wire_bytes, snap.ops) == (150, 150.0, 2)
    assert (c.tensor_bytes, c.wire_bytes, c.ops) == (0, 0.0, 0)


def test_bad_key_is_refused() -> None:
    with pytest.raises(ValueError, match="wan key"):
        WanEmulator(WAN, AB, 0, key="../x")
