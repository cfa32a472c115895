"""Hierarchical all-reduce equals a flat all-reduce: real gloo groups, every layout shape, three dtypes.

Each multi-process run sweeps dtypes × buffer sizes (including buffers smaller than the unit count) ×
inter-DC chunk sizes and compares HAR with ``dist.all_reduce`` on the same data. Integer-valued data has
an exact sum in any order, so there HAR must be bit-exact; random fp32 may differ by summation order
(≤ 1e-6 of the largest value); with two ranks (1 + 1) there is only one addition, so it is bit-exact too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from meridian.workers.distributed.flat_collectives import all_gather_single
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.sync.grad_buffer import GradBuffer
from meridian.workers.sync.har import chunk_views, hierarchical_all_reduce, segment_view
from meridian.workers.sync.inter_dc import InterDCComm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CHUNKS = (None, 8, 100)  # bytes: whole segment, 2–4 elements per chunk, a few dozen


def _har_vs_flat(rank: int, world: int, dcs: tuple[str, ...]) -> list[dict]:
    layout = DCLayout(dcs)
    groups = DCGroups(layout, rank)
    L = layout.units
    rows = []
    for dname, dtype in DTYPES.items():
        for kind in ("random", "integer"):
            if dname == "fp16" and kind == "random":
                continue
            for numel in (1, L + 1, 5 * L + 3, 257):
                for chunk in CHUNKS:
                    padded = -(-numel // L) * L
                    g = torch.Generator().manual_seed(7919 * rank + numel)
                    values = (
                        torch.randn(numel, generator=g)
                        if kind == "random"
                        else torch.randint(-8, 9, (numel,), generator=g)
                    )
                    buf = torch.zeros(padded, dtype=dtype)
                    buf[:numel] = values.to(dtype)
                    flat = buf.clone()
                    dist.all_reduce(flat)
                    comm = InterDCComm()
                    sent = hierarchical_all_reduce(buf, groups, comm, chunk_bytes=chunk)
                    everyone = torch.empty(world * padded, dtype=torch.float32)
                    all_gather_single(everyone, buf.float())
                    segs = [segment_view(buf, groups, s) for s in groups.inter_dc]
                    rows.append(
                        {
                            "dtype": dname,
                            "kind": kind,
                            "numel": numel,
                            "chunk": chunk,
                            "err": float((buf.float() - flat.float()).abs().max()),
                            "scale": float(flat.float().abs().max()),
                            "bit_exact": torch.equal(buf, flat),
                            "same_on_every_rank": bool((everyone.view(world, padded) == buf.float()).all()),
                            "padding_zero": bool((buf[numel:] == 0).all()),
                            "sent": sent,
                            "expected_sent": sum(s.numel() * s.element_size() for s in segs),
                            "calls": comm.calls,
                            "expected_calls": sum(len(chunk_views(s, chunk)) for s in segs),
                            "shard_elems": padded // groups.dc_size,
                        }
                    )
    groups.destroy()
    return rows


LAYOUTS = {
    "2+2": ("a", "a", "b", "b"),
    "2+1": ("a", "a", "b"),
    "3+1": ("a", "a", "a", "b"),
    "1+2+1": ("a", "b", "b", "c"),
    "1+1": ("a", "b"),
    "one DC of 2": ("a", "a"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_har_equals_flat_all_reduce(name):
    dcs = LAYOUTS[name]
    per_rank = run_processes(_har_vs_flat, len(dcs), dcs)
    layout = DCLayout(dcs)
    for rank, rows in enumerate(per_rank):
        assert len(rows) == 5 * 4 * len(CHUNKS)
        for r in rows:
            where = f"{name} rank {rank}: {r}"
            assert r["same_on_every_rank"] and r["padding_zero"], where
            if r["kind"] == "integer" or len(dcs) == 2:
                assert r["bit_exact"], where  # exact sums, or a single addition: order cannot matter
            elif r["dtype"] == "fp32":
                assert r["err"] <= 1e-6 * r["scale"], where
            else:  # bf16: 8 mantissa bits, a few roundings in a different order
                assert r["err"] <= 2e-2 * r["scale"], where
            # Step 2 carries this rank's shard (1/N of the buffer), chunk by chunk, nothing else: once with two
            # DCs (an exchange), 2(k-1)/k times with k (a ring; every edge crosses, one owner per DC).
            if layout.num_dcs > 1:
                esize = DTYPES[r["dtype"]].itemsize
                k = layout.num_dcs
                ring = 1 if k == 2 else 2 * (k - 1) / k
                assert r["expected_sent"] == r["shard_elems"] * esize, where
                assert r["sent"] == pytest.approx(ring * r["expected_sent"], abs=len(CHUNKS) + r["calls"]), where
                per_chunk = max(1, (r["chunk"] or 10**9) // esize)
                assert r["calls"] == r["expected_calls"] >= math.ceil(r["shard_elems"] / per_chunk), where
            else:
                assert r["sent"] == 0 and r["calls"] == 0, where


def test_chunk_views_cover_the_view_in_order():
    v = torch.arange(10.0)
    assert [c.tolist() for c in chunk_views(v, 12)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(chunk_views(v, None)) == 1 and len(chunk_views(v, 1)) == 10  # never an empty chunk
    assert all(
        c.data_ptr() == v[i * 3 :].data_ptr() for i, c in enumerate(chunk_views(v, 12))
    )  # views, no copy


def test_grad_buffer_buckets_by_dtype_and_pads_to_units():
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 3), torch.nn.Linear(3, 2).to(torch.bfloat16), torch.nn.Linear(2, 7)
    )
    buf = GradBuffer(model, bucket_mb=1.0, pad_to=6)
    # Reverse registration order; a dtype change starts a new bucket; each bucket has its params' dtype.
    assert [(b.dtype, [s.name for s in b.slots]) for b in buf.buckets] == [
        (torch.float32, ["2.bias", "2.weight"]),
        (torch.bfloat16, ["1.bias", "1.weight"]),
        (torch.float32, ["0.bias", "0.weight"]),
    ]
    assert [b.padded_numel for b in buf.buckets] == [24, 12, 18] and buf.numel == 21 + 8 + 18
    for b in buf.buckets:
        for s in b.slots:
            assert s.param.grad.data_ptr() == b.grad[s.offset :].data_ptr() and s.param.grad.dtype == b.dtype
    before = [p.detach().clone() for p in model.parameters()]
    buf.flatten_params()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    b0 = buf.buckets[0]
    b0.data.fill_(3.0)
    assert (model[2].weight == 3).all()  # parameters are views of the flat buffer


def test_tiny_buckets_one_parameter_each():
    model = torch.nn.Linear(4, 3)
    buf = GradBuffer(model, bucket_mb=4 / 2**20, pad_to=6)  # 4-byte cap: one parameter per bucket
    assert [len(b.slots) for b in buf.buckets] == [1, 1]
    assert [b.padded_numel for b in buf.buckets] == [6, 12]
