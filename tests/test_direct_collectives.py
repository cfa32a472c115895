"""The direct in-datacenter reduce-scatter and all-gather equal gloo's collectives, and fail like them.

Real gloo groups of 2, 3 and 4 ranks (and a subgroup that skips a rank), fp32 / bf16 / fp16, the output in
place or in another buffer. Integer-valued data sums exactly in any order, so there the direct reduce-scatter
must match ``reduce_scatter_single`` bit for bit; random fp32 may differ by summation order.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meridian.workers.distributed import direct_collectives as direct
from meridian.workers.distributed.flat_collectives import all_gather_single, reduce_scatter_single
from meridian.workers.distributed.multiproc import run_processes

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _values(rank: int, numel: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(104729 * rank + numel)
    v = torch.randn(numel, generator=g) if kind == "random" else torch.randint(-8, 9, (numel,), generator=g).float()
    return v.to(dtype)


def _against_collectives(rank: int, world: int, members: tuple[int, ...]) -> list[dict]:
    group = dist.new_group(list(members))
    rows = []
    if rank not in members:
        return rows
    n, me = len(members), members.index(rank)
    for dtype in DTYPES:
        for kind in ("integer", "random"):
            for numel in (n, 7 * n, 1000 * n):
                buf = _values(rank, numel, dtype, kind)
                ref = torch.empty(numel // n, dtype=dtype)
                reduce_scatter_single(ref, buf.clone(), group=group)
                into = torch.zeros_like(buf)  # output in another buffer: buf left as it was
                direct.reduce_scatter(into.split(numel // n)[me], buf, group)
                in_place = buf.clone()  # output in buf's own slice
                direct.reduce_scatter(in_place.split(numel // n)[me], in_place, group)
                gathered = torch.zeros_like(buf)
                gathered.split(numel // n)[me].copy_(buf.split(numel // n)[me])
                work = direct.all_gather(gathered, group, async_op=True)
                work.wait()
                expected = torch.empty_like(buf)
                all_gather_single(expected, buf.split(numel // n)[me].clone(), group=group)
                mine = into.split(numel // n)[me]
                rows.append({
                    "dtype": str(dtype), "kind": kind, "numel": numel,
                    "exact": torch.equal(mine, ref),
                    "err": float((mine.float() - ref.float()).abs().max()),
                    "scale": float(ref.float().abs().max()),
                    "in_place_same": torch.equal(in_place.split(numel // n)[me], mine),
                    "others_untouched": all(torch.equal(into.split(numel // n)[i], torch.zeros(numel // n, dtype=dtype))
                                            for i in range(n) if i != me),  # fmt: skip
                    "input_untouched": torch.equal(buf, _values(rank, numel, dtype, kind)),
                    "gathered": torch.equal(gathered, expected),
                })
    return rows


@pytest.mark.parametrize("world,members", [(2, (0, 1)), (3, (0, 1, 2)), (4, (0, 1, 2, 3)), (4, (0, 2, 3))])
def test_direct_reduce_scatter_and_all_gather_equal_glooS_collectives(world, members):
    for rank_rows in run_processes(_against_collectives, world, members):
        for row in rank_rows:
            assert row["in_place_same"] and row["others_untouched"] and row["input_untouched"], row
            assert row["gathered"], row
            if row["kind"] == "integer" or len(members) == 2:  # exact sums; two ranks add once, in either order
                assert row["exact"], row
            else:
                tol = 1e-6 if row["dtype"] == "torch.float32" else 1e-2
                assert row["err"] <= tol * max(1.0, row["scale"]), row


def _threads_do_not_cross(rank: int, world: int) -> bool:
    """A reduce-scatter on one thread and an all-gather on another, in flight at once and issued in opposite
    orders on the two ranks, each get their own data: the two use tags of their own."""
    group = dist.new_group([0, 1])
    n = 1 << 16
    ok = []
    for step in range(20):
        grads = torch.full((2 * n,), float(rank + 1 + step))
        params = torch.zeros(2 * n)
        params.split(n)[rank].fill_(100.0 * (rank + 1) + step)
        scatter = threading.Thread(target=direct.reduce_scatter, args=(grads.split(n)[rank], grads, group))
        if rank == 0:  # the two ranks issue them in opposite orders
            gathers = direct.all_gather(params, group, async_op=True)
            scatter.start()
        else:
            scatter.start()
            time.sleep(0.02)
            gathers = direct.all_gather(params, group, async_op=True)
        scatter.join()
        gathers.wait()
        ok.append(bool((grads.split(n)[rank] == 3.0 + 2 * step).all())
                  and bool((params.split(n)[0] == 100.0 + step).all())
                  and bool((params.split(n)[1] == 200.0 + step).all()))  # fmt: skip
    return all(ok)


def test_a_reduce_scatter_and_an_all_gather_in_flight_together_keep_their_data():
    assert run_processes(_threads_do_not_cross, 2) == [True, True]


def _silent_peer(rank: int, world: int) -> tuple[str, float]:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(6)  # alive, never answers
        return "silent", 0.0
    t0 = time.monotonic()
    try:
        direct.reduce_scatter(torch.zeros(4)[:2], torch.zeros(4), group)
    except RuntimeError as exc:
        return f"raised: {exc}"[:200], time.monotonic() - t0
    return "returned", time.monotonic() - t0


def test_a_silent_peer_fails_the_reduce_scatter_at_the_groups_timeout():
    (outcome, waited), _ = run_processes(_silent_peer, 2, timeout_s=60)
    assert outcome.startswith("raised"), outcome
    assert 1.5 <= waited <= 5.0, waited


def _peer_that_leaves(rank: int, world: int) -> tuple[str, float]:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    dist.barrier(group)
    if rank == 1:
        time.sleep(2)
        return "left", 0.0  # and its process ends, closing its connections
    t0 = time.monotonic()
    try:
        direct.all_gather(torch.zeros(4), group)
    except RuntimeError:
        return "raised", time.monotonic() - t0
    return "returned", time.monotonic() - t0


def test_a_peer_whose_process_ends_fails_the_all_gather_then_not_at_the_timeout():
    (outcome, waited), _ = run_processes(_peer_that_leaves, 2, timeout_s=60)
    assert outcome == "raised"
    assert waited < 10, waited  # the group's timeout is 30 s


def test_only_cpu_buffers_go_direct():
    assert direct.serves(torch.zeros(2))
    assert not direct.serves(torch.zeros(2, device="meta"))


def test_a_buffer_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="multiple of 3"):
        direct._slices(torch.zeros(7), 3)
