"""The two-datacenter sum as one pairwise exchange: each owner sends its chunk to the other and adds.

What it is for: HAR step 2 (and DiLoCo's outer sync) with exactly two owners. ``dist.all_reduce`` over two
ranks is a ring of two steps, and each gloo step waits a round trip, so it pays two RTTs; an exchange sends
the same bytes (the whole chunk each way instead of half of it twice) in one step: one RTT. On the lab
(real TCP, 4 KiB) it took 24 ms against the all-reduce's 55 ms at 21 ms RTT, and 101 against 204 ms at 100
ms. gloo's send/recv also bypass the process group's two worker threads, so every exchange of a bucket is
in flight at once. The sum is ``mine + theirs`` on one owner and ``theirs + mine`` on the other: IEEE
addition commutes, so both hold the same bits. What it must never do: touch the chunk before both
transfers are done, or serve a group that is not two ranks.

That round trip is gloo's, not the data's: its TCP pair holds a send until the receiver has announced the
matching receive, so an exchange posted on both sides at once waits one way for the announcements and one way
for the data. :class:`PostedReceives` removes the first: as soon as an exchange is summed, the receive of the
same chunk's next exchange is posted (and announced), so next step the peer's data flows the moment it is
sent. On the lab at 21 ms RTT, 20 exchanges after 100 ms of idle each: 4 KiB 21.7 → 11.0 ms, 1 MiB 40.0 →
20.0 ms on average. The cost: each chunk's receive buffer stays allocated between steps.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.distributed as dist

from meridian.workers.wan.emulator import Algorithm, WanEmulator, sleep_until

_WAITER = ThreadPoolExecutor(1, thread_name_prefix="meridian-exchange")
"""Waits for each exchange's real transfers, in issue order, and notes when they were done (under the emulator:
books the link then). gloo's send/recv work reports completion only once waited for, so polling cannot."""


_TAGS: weakref.WeakKeyDictionary[dist.ProcessGroup, itertools.count[int]] = weakref.WeakKeyDictionary()
"""Per process group object: the next point-to-point tag for a posted exchange. Never reused on a group, so a
receive left posted by a closed engine can never take a later engine's data on it; and every new group starts
from :data:`FIRST_TAG` on every rank, whatever each process ran before (a newcomer and the ranks that were
already training re-form into new groups and must agree)."""
FIRST_TAG = 1 << 20
"""Above the tags anything else sends with (0 by default)."""


class PostedReceives:
    """Every exchange's next receive, posted as soon as the exchange is summed (module docstring).

    An exchange is named by its caller's ``key`` (the same chunk of the same bucket every step); each key gets
    a tag of its own on its group when first seen. Both owners name their exchanges in the same order, so they
    agree on the tags without talking. A receive still posted when the engine closes is left to the group's
    teardown (never matched: its tag is never used again)."""

    def __init__(self) -> None:
        self._tags: dict[Hashable, int] = {}
        self._posted: dict[Hashable, tuple[torch.Tensor, dist.Work]] = {}

    def tag(self, key: Hashable, group: dist.ProcessGroup) -> int:
        if key not in self._tags:
            self._tags[key] = next(_TAGS.setdefault(group, itertools.count(FIRST_TAG)))
        return self._tags[key]

    def take(self, key: Hashable, like: torch.Tensor) -> tuple[torch.Tensor, dist.Work] | None:
        """The receive posted for ``key``'s exchange, if any (its buffer, its work)."""
        posted = self._posted.pop(key, None)
        if posted is not None and (posted[0].shape != like.shape or posted[0].dtype != like.dtype):
            raise ValueError(f"exchange {key!r} was {tuple(posted[0].shape)} {posted[0].dtype} and is now "
                             f"{tuple(like.shape)} {like.dtype}: one key must name the same chunk every time")
        return posted

    def post(self, key: Hashable, buffer: torch.Tensor, peer: int, group: dist.ProcessGroup) -> None:
        """Post ``key``'s next receive; not posted when the pair is already closed (the peer left after this
        exchange completed, e.g. at the end of a job or a resize). That failure belongs to the next exchange,
        which then posts afresh and fails where it matters, never to the one that just completed.

        Nor when one is posted already: two exchanges of ``key`` summed with no new one issued between them (a
        sync one step late, landed early by ``synchronize``) would post two receives on one tag. gloo fills the
        first with the next exchange's data, and a second one kept in its place would wait for ever."""
        if key in self._posted:
            return
        try:
            work = dist.irecv(buffer, peer, group=group, tag=self.tag(key, group))
        except RuntimeError:  # gloo: "Connection closed by peer"
            return
        self._posted[key] = (buffer, work)

    def __len__(self) -> int:
        return len(self._posted)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers posted now (memory the exchanges hold between syncs)."""
        return sum(b.numel() * b.element_size() for b, _ in self._posted.values())


def add_theirs(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    mine.add_(theirs)


class ExchangeWork:
    """Handle of an in-flight exchange; :meth:`wait` leaves the sum of both owners' chunks in ``tensor``, or
    whatever ``combine(tensor, theirs)`` makes of the two (it runs before ``theirs``' buffer is reused).

    With ``receives`` and ``key`` the exchange takes the receive posted for it last time (if any) and, once
    combined, posts the next one."""

    def __init__(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        emulator: WanEmulator | None = None,
        group_ranks: Sequence[int] | None = None,
        receives: PostedReceives | None = None,
        key: Hashable = None,
        combine: Callable[[torch.Tensor, torch.Tensor], None] = add_theirs,
    ) -> None:
        if dist.get_world_size(group) != 2:
            raise ValueError(f"an exchange is between two ranks; this group has {dist.get_world_size(group)}")
        peer = dist.get_global_rank(group, 1 - dist.get_rank(group))
        self._tensor, self._combine = tensor, combine
        self._next = (receives, key, peer, group) if receives is not None and key is not None else None
        posted = receives.take(key, tensor) if receives is not None and key is not None else None
        settle: Callable[[], float] | None = None
        plan = emulator.plan(group, group_ranks) if emulator is not None and emulator.enabled else None
        if plan is not None and plan.crosses:
            assert emulator is not None
            emu, nbytes = emulator, tensor.numel() * tensor.element_size()
            cost = emu.cost(Algorithm.EXCHANGE, plan.ranks, nbytes)
            emu.counter.add(nbytes, cost.bytes_of(emu.rank))
            seq, group_tag = emu.next_seq(plan.tag), plan.tag  # in issue order, the same on both owners
            if posted is None:
                # Booked when the real transfers are done (both owners had sent: the later one's issue is when the
                # exchange could start, the receives announced then), by whichever owner gets there first; not held
                # behind the group's collectives, since send/recv do not queue on its worker threads.
                settle = lambda: emu.settle(cost, tag=group_tag, seq=seq, start=time.monotonic(), in_flight=0)  # noqa: E731
            else:
                # The peer's receive was announced a step ago (it posts when we do): our bytes go on our outbound
                # link the moment we send, and the data lands one way after the last of them left.
                cost = replace(cost, rounds=1)
                emu.book_outbound(cost, tag=group_tag, seq=seq, start=time.monotonic())  # before the data can arrive
                settle = lambda: emu.settle_outbound(cost, tag=group_tag, seq=seq)  # noqa: E731
        if self._next is None:
            self._theirs = torch.empty_like(tensor)
            ops = [dist.P2POp(dist.isend, tensor, peer, group), dist.P2POp(dist.irecv, self._theirs, peer, group)]
            self._works = dist.batch_isend_irecv(ops)
        else:
            assert receives is not None
            tag = receives.tag(key, group)
            if posted is None:
                self._theirs = torch.empty_like(tensor)
                received = dist.irecv(self._theirs, peer, group=group, tag=tag)
            else:
                self._theirs, received = posted
            self._works = [dist.isend(tensor, peer, group=group, tag=tag), received]
        self._ready_at: float | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        _WAITER.submit(self._wait_real, settle)
        self._summed = False

    def _wait_real(self, settle: Callable[[], float] | None) -> None:
        try:
            for w in self._works:
                w.wait()
            self._ready_at = settle() if settle is not None else time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set() and self._ready_at is not None and time.monotonic() >= self._ready_at

    def wait(self) -> bool:
        if not self._summed:
            self._done.wait()
            if self._error is not None:
                raise self._error
            assert self._ready_at is not None
            sleep_until(self._ready_at)
            if self._tensor.is_cuda:
                # Waited again here, on the thread that combines: on NCCL a work's wait() orders the *calling*
                # thread's current CUDA stream after the transfer (streams are per thread), so the waiter thread's
                # wait ordered nothing for the combine below, which could read a receive not yet landed. (Not on
                # gloo: the waiter's wait finished the transfer into host memory, and a second wait() of a gloo
                # send/receive never returns.)
                for w in self._works:
                    w.wait()
            self._combine(self._tensor, self._theirs)
            self._summed = True
            if self._next is not None:  # announce the receive of this chunk's next exchange now
                receives, key, peer, group = self._next
                receives.post(key, self._theirs, peer, group)
        return True
