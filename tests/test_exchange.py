"""Exchanges whose next receive is posted ahead: the same sums, one way instead of a round trip, and a later
engine on the same group never takes a closed one's data."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from wan_helpers import AB
from wan_helpers import late as _late
from wan_helpers import new_key as _key

from meridian.workers.contracts.config import WanConfig
from meridian.workers.distributed.layout import DCGroups
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.wan.collectives import WanEmulator, cleanup
from meridian.workers.wan.exchange import ExchangeWork, PostedReceives

SLOW = WanConfig(rtt_ms=200.0, gbps=10.0)  # 100 ms one way: a round trip and one way are far apart
STEPS = 4
CHUNKS = 3
SKEW_S = 0.3


def _exchanges(rank: int, world: int, key: str) -> dict:
    emu = WanEmulator(SLOW, AB, rank, key=key)
    groups = DCGroups(AB, rank)
    ((seg, group),) = groups.inter_dc.items()
    receives = PostedReceives()
    out: dict = {"sums": [], "posted": [], "waited": []}
    for step in range(STEPS):
        chunks = [torch.full((1000 * (c + 1),), float(10 * step + rank + c)) for c in range(CHUNKS)]
        dist.barrier()
        t0 = time.monotonic()
        works = [ExchangeWork(x, group, emulator=emu, group_ranks=seg.owners, receives=receives, key=c)
                 for c, x in enumerate(chunks)]  # fmt: skip
        for w in works:
            w.wait()
        out["waited"].append(time.monotonic() - t0)
        out["sums"].append([(x.min().item(), x.max().item()) for x in chunks])
        out["posted"].append(len(receives))
    # One owner sends 0.3 s after the other: with its receive announced, the early owner's bytes go on its
    # outbound link at once, not when the late one sends.
    x = torch.full((1000,), 1.0)
    dist.barrier()
    if rank == 1:
        time.sleep(SKEW_S)
    out["issued"] = time.monotonic()
    ExchangeWork(x, group, emulator=emu, group_ranks=seg.owners, receives=receives, key=0).wait()
    out["outbound_free_at"] = emu.link(*(("dc-a", "dc-b") if rank == 0 else ("dc-b", "dc-a"))).free_at()
    out["done"] = time.monotonic()
    # A later engine on the same group, its keys named alike: the first one's posted receives stay unmatched.
    later = PostedReceives()
    x = torch.full((1000,), float(rank + 1))
    ExchangeWork(x, group, receives=later, key=0).wait()
    out["later"] = (x.min().item(), x.max().item())
    out["tags"] = (receives.tag(0, group), later.tag(0, group))
    emu.close()
    groups.destroy()
    return out


def test_posted_receives_give_the_same_sums_at_one_way_after_the_first_exchange():
    key = _key()
    try:
        per_rank = run_processes(_exchanges, 2, key)
    finally:
        cleanup(key)
    one_way, rtt = SLOW.one_way_s, 2 * SLOW.one_way_s
    for out in per_rank:
        for step, sums in enumerate(out["sums"]):
            assert sums == [(20.0 * step + 1 + 2 * c,) * 2 for c in range(CHUNKS)], step
        assert out["posted"] == [CHUNKS] * STEPS  # every chunk's next receive is out after each step
        assert out["waited"][0] >= rtt  # nothing was posted yet: the announcement, then the data
        for waited in out["waited"][1:]:
            assert one_way <= waited < min(_late(one_way), rtt), out["waited"]
        assert out["later"] == (3.0, 3.0)
    early, late_rank = per_rank
    assert early["outbound_free_at"] < late_rank["issued"]  # booked when sent, not when the peer sent
    assert late_rank["outbound_free_at"] >= late_rank["issued"]
    for out in per_rank:  # both finish one way after the late owner's bytes left
        assert out["done"] >= late_rank["issued"] + one_way
        assert out["tags"][1] > out["tags"][0]  # never reused on the group


def _through_comm(rank: int, world: int, backend: str) -> tuple[int, float]:
    from meridian.workers.sync.inter_dc import InterDCComm

    groups = DCGroups(AB, rank)
    ((seg, group),) = groups.inter_dc.items()
    if backend != "gloo":  # what InterDCComm sees on a GPU; the collectives still run on gloo here
        dist.get_backend = lambda group=None: backend
    comm = InterDCComm()
    x = torch.full((8,), float(rank + 1))
    comm.all_reduce_async(x, group, seg, key=(0, 0)).wait()
    posted = len(comm._receives)
    groups.destroy()
    return posted, x[0].item()


def test_only_gloo_posts_receives_ahead():
    # NCCL runs a pair's point-to-point operations in order on one stream: a receive posted a step ahead would
    # hold the next send behind it on both owners.
    assert run_processes(_through_comm, 2, "gloo") == [(1, 3.0), (1, 3.0)]
    assert run_processes(_through_comm, 2, "nccl") == [(0, 3.0), (0, 3.0)]


def _peer_gone_before_the_next_post(rank: int, world: int) -> tuple[float, int]:
    groups = DCGroups(AB, rank)
    ((seg, group),) = groups.inter_dc.items()
    receives = PostedReceives()
    x = torch.full((1000,), float(rank + 1))
    work = ExchangeWork(x, group, group_ranks=seg.owners, receives=receives, key=0)
    if rank == 1:
        work.wait()  # summed, its next receive posted: now it leaves, closing its side of the pair
        groups.destroy()
        return x[0].item(), len(receives)
    time.sleep(1.0)  # rank 0 sums only after its peer is gone
    work.wait()
    posted = len(receives)
    groups.destroy()
    return x[0].item(), posted


def test_an_exchange_that_completed_is_not_failed_by_a_peer_that_left_after_it():
    # The data had arrived; only posting the *next* receive meets the closed pair. That failure belongs to the
    # next exchange (which posts afresh and fails there if the peer is really gone), not to this one.
    (mine, posted), (theirs, _) = run_processes(_peer_gone_before_the_next_post, 2)
    assert mine == theirs == 3.0
    assert posted == 0


def _first_exchange_posted_ahead(rank: int, world: int, key: str, compression: str, backend: str) -> dict:
    from meridian.workers.contracts.config import Compression
    from meridian.workers.sync.inter_dc import InterDCComm

    emu = WanEmulator(SLOW, AB, rank, key=key)
    groups = DCGroups(AB, rank)
    ((seg, group),) = groups.inter_dc.items()
    if backend != "gloo":  # what InterDCComm sees on a GPU; the collectives still run on gloo here
        dist.get_backend = lambda group=None: backend
    comm = InterDCComm(Compression(compression), emulator=emu)
    x = torch.full((300,), float(rank + 1))
    comm.post_receive(x, group, seg, key=(0, 0))
    posted = len(comm._receives)
    dist.barrier()
    t0 = time.monotonic()
    comm.all_reduce_async(x, group, seg, key=(0, 0)).wait()
    out = {"posted": posted, "waited": time.monotonic() - t0, "sum": x.tolist()}
    emu.close()
    groups.destroy()
    return out


def test_a_receive_posted_before_the_first_exchange_makes_it_one_way_in_every_encoding():
    # DiLoCo posts each chunk's first receive when its engine starts: a fragment's first sync, like every later
    # one, then waits one way (plus the transfer), not the round trip gloo needs to announce a receive.
    one_way, rtt = SLOW.one_way_s, 2 * SLOW.one_way_s
    for compression in ("none", "bf16", "int8", "int4"):
        key = _key()
        try:
            per_rank = run_processes(_first_exchange_posted_ahead, 2, key, compression, "gloo")
        finally:
            cleanup(key)
        for out in per_rank:
            assert out["posted"] == 1, compression
            assert one_way <= out["waited"] < min(_late(one_way), rtt), (compression, out["waited"])
            torch.testing.assert_close(torch.tensor(out["sum"]), torch.full((300,), 3.0), rtol=2e-2, atol=0)
    key = _key()
    try:
        per_rank = run_processes(_first_exchange_posted_ahead, 2, key, "int4", "nccl")
    finally:
        cleanup(key)
    for out in per_rank:  # not on NCCL (see above): the first exchange is the round trip it always was there
        assert out["posted"] == 0
        assert out["waited"] >= rtt


def test_the_combine_waits_on_the_transfers_from_its_own_thread(monkeypatch):
    # On NCCL, Work.wait() orders the calling thread's current stream after the transfer; it ran only on the waiter
    # thread, so the combine (on the communication stream) could read a receive not yet landed. Fake works record
    # which threads waited on them.
    import threading

    import meridian.workers.wan.exchange as exchange

    class FakeWork:
        def __init__(self):
            self.waited_on: list[str] = []

        def wait(self, *args):
            self.waited_on.append(threading.current_thread().name)
            return True

    works: list[FakeWork] = []

    def batch(ops):
        works.extend(FakeWork() for _ in ops)
        return works

    monkeypatch.setattr(exchange.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(exchange.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(exchange.dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(exchange.dist, "P2POp", lambda *args, **kwargs: None)
    monkeypatch.setattr(exchange.dist, "batch_isend_irecv", batch)
    cuda_like = torch.ones(4)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self is cuda_like))  # as a CUDA tensor would
    work = ExchangeWork(cuda_like, group=object())
    combined_on: list[str] = []
    work._combine = lambda mine, theirs: combined_on.append(threading.current_thread().name)
    work.wait()
    assert len(works) == 2 and combined_on == [threading.current_thread().name]
    assert all(combined_on[0] in w.waited_on for w in works), [w.waited_on for w in works]


def test_chunk_views_cover_the_view_in_order():
    from meridian.workers.sync.shard_exchange import chunk_views

    v = torch.arange(10.0)
    assert [c.tolist() for c in chunk_views(v, 12)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(chunk_views(v, None)) == 1 and len(chunk_views(v, 1)) == 10  # never an empty chunk
    assert all(
        c.data_ptr() == v[i * 3 :].data_ptr() for i, c in enumerate(chunk_views(v, 12))
    )  # views, no copy
