"""The prefetching store serves a get that follows a wait from the wait's own round trip, and gloo forms its
groups over it with fewer store operations."""

from __future__ import annotations

import collections
import json
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meridian.workers.distributed.prefetch_store import PrefetchingStore


class CountingStore(dist.Store):
    """A store that counts the operations that reach it (each one a round trip to a TCPStore's server)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.ops = inner, collections.Counter()
        self._lock = threading.Lock()

    def _call(self, op, *args):
        with self._lock:
            self.ops[op] += 1
        return getattr(self.inner, op)(*args)

    def set(self, k, v):
        return self._call("set", k, v)

    def get(self, k):
        return self._call("get", k)

    def add(self, k, v):
        return self._call("add", k, v)

    def wait(self, keys, timeout=None):
        return self._call("wait", keys) if timeout is None else self._call("wait", keys, timeout)

    def multi_get(self, keys):
        return self._call("multi_get", keys)

    def multi_set(self, keys, values):
        return self._call("multi_set", keys, values)

    def check(self, keys):
        return self._call("check", keys)

    def compare_set(self, k, e, d):
        return self._call("compare_set", k, e, d)

    def delete_key(self, k):
        return self._call("delete_key", k)

    def append(self, k, v):
        return self._call("append", k, v)

    def num_keys(self):
        return self._call("num_keys")

    def has_extended_api(self):
        return True


def _tcp_store(timeout_s: float = 5.0) -> tuple[dist.TCPStore, dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return server, client


def test_a_get_after_its_wait_costs_no_round_trip_and_a_key_set_here_is_fetched_again():
    server, client = _tcp_store()
    counted = CountingStore(client)
    store = PrefetchingStore(counted)
    threading.Timer(0.2, lambda: server.multi_set(["a", "b"], [b"1", b"2"])).start()
    store.wait(["a", "b"])  # blocks until both exist, as a wait does
    assert store.get("a") == b"1" and store.get("b") == b"2"
    assert counted.ops == {"multi_get": 1}  # one round trip for the wait and both gets
    assert store.get("a") == b"1" and counted.ops["get"] == 1  # served once; then from the store
    store.wait(["a"])
    store.set("a", b"3")  # this process changed it: what the wait fetched is not served
    assert store.get("a") == b"3"
    store.wait(["b"])
    assert store.add("b", 0) == 2 and store.get("b") == b"2" and counted.ops["get"] == 3
    assert store.check(["a", "b"]) and not store.check(["c"])


def test_a_wait_for_a_key_nobody_sets_times_out_with_the_store_s_error():
    _server, client = _tcp_store(timeout_s=0.5)
    began = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        PrefetchingStore(client).wait(["never"])
    assert time.monotonic() - began < 5


_RANK = r"""
import collections, json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from test_prefetch_store import CountingStore
from meridian.workers.distributed.layout import DCLayout, make_groups
from meridian.workers.distributed.prefetch_store import PrefetchingStore
rank, port, prefetch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
tcp = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=30))
counted = CountingStore(tcp)
store = PrefetchingStore(counted) if prefetch else counted  # (a Python store must outlive its groups)
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=30))
world, intra, inter = make_groups(DCLayout(("dc-a", "dc-a", "dc-b")), (0, 1, 2), backend="gloo")
x = torch.full((4,), float(rank))
dist.all_reduce(x)
for g in [*intra.values(), *inter.values()]:
    if dist.get_rank(g) >= 0:
        dist.all_reduce(x, group=g)
print(json.dumps({"rank": rank, "ops": sum(counted.ops.values()), "x": x.tolist()}), flush=True)
dist.destroy_process_group()
os._exit(0)  # as a training process ends (an interpreter's own exit after this sometimes aborts, store or not)
"""


def _form(prefetch: bool, tmp_path) -> list[dict]:
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(__file__)
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(port), "1" if prefetch else "0", here],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def test_gloo_forms_a_layout_s_groups_over_it_with_fewer_round_trips(tmp_path):
    plain, prefetched = _form(False, tmp_path), _form(True, tmp_path)
    # the same sums either way (the groups work), and every rank made fewer store calls
    assert [r["x"] for r in plain] == [r["x"] for r in prefetched]
    for p, q in zip(plain, prefetched, strict=True):
        assert q["ops"] < p["ops"], (p, q)
    assert torch.tensor(prefetched[2]["x"]).ne(0).all()
