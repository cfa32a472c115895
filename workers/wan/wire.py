"""Bytes a collective puts on the wire, from the tensor sizes actually passed and the algorithm that runs.

What it is for: the inter-DC byte counts every engine reports. gloo and NCCL run an all-reduce as a ring in
group-rank order (reduce-scatter then all-gather, ``2(W−1)`` rounds): each rank sends ``2(W−1)/W`` of the
tensor to its successor; a ring all-gather sends ``(W−1)`` payloads to the successor; a send or a pairwise
exchange sends the tensor once. Only edges whose two ends lie in different datacenters count. What it must
never do: charge a formula of the model size instead of what was passed, or charge traffic inside one DC.

Checked against the kernel's per-socket counters on loopback (tests/test_wire_bytes.py) and against the lab's
link device (``meridian bench lab``).
"""

from __future__ import annotations

from collections.abc import Sequence


def ring_all_reduce_edge(world: int, nbytes: float) -> float:
    """Bytes each rank of a ``world``-rank ring all-reduce sends to its successor."""
    return 2 * (world - 1) / world * nbytes if world > 1 else 0.0


def ring_all_gather_edge(world: int, nbytes: float) -> float:
    """Bytes each rank of a ``world``-rank ring all-gather of ``nbytes`` per rank sends to its successor."""
    return (world - 1) * nbytes if world > 1 else 0.0


def crosses_to_successor(ring: Sequence[str], index: int) -> bool:
    """Whether the ring edge from position ``index`` to the next position joins two datacenters
    (``ring``: the datacenter of every position, in group-rank order)."""
    return len(ring) > 1 and ring[index] != ring[(index + 1) % len(ring)]


def ring_all_reduce_sent(ring: Sequence[str], index: int, nbytes: float) -> float:
    """Inter-DC bytes position ``index`` of a ring all-reduce of ``nbytes`` sends."""
    return ring_all_reduce_edge(len(ring), nbytes) if crosses_to_successor(ring, index) else 0.0


# What a gloo collective waits for, measured on the network lab (``meridian lab``, real TCP between two network
# namespaces, 4 KiB tensors so that bytes do not count): at 21 ms and at 100 ms RTT, a 2-rank all_reduce took
# 2.0-2.6 RTT, an all_gather 1.0-1.3 RTT and an isend/irecv exchange 1.0-1.1 RTT. So each step of a gloo
# algorithm (a send to a peer and a receive from one, posted together) waits a whole round trip, not one way:
# gloo's TCP pair announces a posted receive to the sender before the sender's data flows. A receive posted a
# step ahead has announced itself already: such an exchange waited ~0.5 RTT on the lab (4 KiB: 11.0 ms at 21 ms).
ONE_WAYS_PER_STEP = 2
"""One-way latencies one step of a gloo collective (ring step, exchange, send) waits."""
RING_ALL_REDUCE_STEPS = 2  # per (W - 1): reduce-scatter then all-gather
IN_FLIGHT_PER_GROUP = 2
"""Collectives of one process group that run at once: ProcessGroupGloo runs its queue on 2 threads (its
default ``threads``); on the lab 8 async 2-rank all_reduces took 4× one, not 8× or 1×."""


def ring_steps(world: int, *, gather: bool = False) -> int:
    """Steps of a ring all-reduce (``2(W−1)``) or all-gather (``W−1``) over ``world`` ranks."""
    return (world - 1) * (1 if gather else RING_ALL_REDUCE_STEPS)
