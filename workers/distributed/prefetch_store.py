"""A rendezvous store that answers gloo's "wait for the key, then get it" in one round trip instead of two.

Every process group gloo forms (the default group and each subgroup: a datacenter's, each inter-DC segment's)
exchanges its ranks' addresses through the default group's store: each rank sets its own key, then, for each
peer, waits for the peer's key and gets it. Both are a round trip to the store, which lives in rank 0's process,
in the first datacenter: a rank in another datacenter pays the WAN's round trip for every one. Counted on 3 ranks
in a 2 + 1 layout (a throwaway counting store): the default group took each rank 1 set, 3 waits and 3 gets; the
layout's four subgroups took the lone dc-b rank 3 sets, 5 waits and 5 gets. Measured across the lab at 21 ms, a
re-formed epoch's groups took 0.52 s to set up (``bench recovery --cluster ray-start --lab-rtt-ms 21``).

:class:`PrefetchingStore` wraps the store: a ``wait`` fetches the values of the keys it waits for in the same
call (``multi_get`` blocks until every key exists, as ``wait`` does), and the ``get`` that follows is served from
them. What it serves is exactly what the store held when the wait returned; a key this process sets, adds to or
deletes afterwards is fetched again. The keys gloo exchanges are written once, by their owner. The wait's
timeout is the store's own (``multi_get`` takes none): the rendezvous makes its store with the collective timeout,
which is also every group's.

CPU (gloo) only: a store written in Python is called with the GIL, and NCCL's watchdog thread uses the store
too; that is not checked on a GPU (:meth:`meridian.workers.elastic.rendezvous.Rendezvous.form` picks).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class PrefetchingStore(dist.Store):
    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self._fetched: dict[str, bytes] = {}
        self._lock = threading.Lock()

    # -- what it changes ---------------------------------------------------------------------------------
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        values = self.inner.multi_get(list(keys))
        with self._lock:
            self._fetched.update(zip(keys, values, strict=True))

    def get(self, key: str) -> bytes:
        with self._lock:
            value = self._fetched.pop(key, None)
        return self.inner.get(key) if value is None else value

    def _forget(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._fetched.pop(key, None)

    # -- what it passes on (a key this process changes is fetched again) ---------------------------------
    def set(self, key: str, value: Any) -> None:
        self._forget(key)
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        self._forget(key)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._forget(key)
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        self._forget(key)
        return self.inner.delete_key(key)

    def append(self, key: str, value: Any) -> None:
        self._forget(key)
        self.inner.append(key, value)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._forget(*keys)
        self.inner.multi_set(keys, values)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.inner.multi_get(keys)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return True
