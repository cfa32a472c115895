"""The worker side of an elastic job's rendezvous: join an epoch, form its process group, tear it down.

The coordinator lives in the job's runner actor; this module reaches it through a ``call(method, *args)``
function (a Ray actor call in production, a direct call in tests), so it never imports the service. The
messages both sides exchange are the torch-free dataclasses of :mod:`meridian.workers.contracts.rendezvous`.

Tearing down matters as much as forming: when a peer dies, the ranks talking to it get an error at once,
but ranks blocked on a *live* peer that already gave up would wait for the full collective timeout.
Destroying every group closes this rank's sockets, so those peers fail within milliseconds too (measured
here: 0.2 s from a death to the last rank's error) and the whole job converges on the next epoch.

Every joiner hosts a store server *while it joins*, on the port it offers: whichever becomes rank 0 already
listens when its peers connect. A store started at formation raced its clients, and a client that found
nothing listening backed off for 0.3–0.65 s before trying again (measured: a re-formation's group took
0.65 s to form instead of 0.015 s), and a port picked early could be taken by then.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meridian.workers.contracts.rendezvous import Assignment, Finished, JoinRequest, Waiting
from meridian.workers.distributed.devices import bind_device, init_kwargs
from meridian.workers.distributed.ports import on_low_port
from meridian.workers.distributed.prefetch_store import PrefetchingStore

Call = Callable[..., Any]


class RendezvousTimeout(RuntimeError):
    pass


class JobFinished(Exception):
    """The job's last step is done: a worker still waiting to join has nothing to do."""


class StoreNotHosted(RuntimeError):
    """This rank is an epoch's rank 0 but the epoch names a store port other than the one it hosts: its peers
    connect where it does not listen. It leaves the epoch and joins again (the coordinator stops peers that
    stay stuck connecting)."""


def host_store(host: str, timeout: timedelta) -> dist.TCPStore:
    """A store server listening now on a free port below the ephemeral range (see
    :mod:`meridian.workers.distributed.ports`)."""
    return on_low_port(lambda port: dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                                  timeout=timeout))  # fmt: skip


def prehost_store() -> dist.TCPStore | None:
    """A store server for a standby's first join, hosted while it waits for its ``go`` (the server listens on
    every address; the join sets its timeout). A cold process took 8-20 ms to host one on two busy cores, on the
    critical path of every re-formation; ``None`` if it cannot (the join then hosts one)."""
    try:
        return host_store("127.0.0.1", timedelta(seconds=300))
    except (OSError, RuntimeError):
        return None


class Rendezvous:
    _group_store: dist.Store | None = None
    """The store this process's groups were made over, while they live (see :meth:`form`)."""

    def __init__(self, call: Call, *, worker_id: str, datacenter: str, node_id: str, address: str | None = None,
                 backend: str | None = None, collective_timeout_s: float = 300.0, device: str = "cpu",
                 probe_port: int = 0, store: dist.TCPStore | None = None) -> None:
        self.call = call
        self.worker_id = worker_id
        self.datacenter = datacenter
        self.node_id = node_id
        self.address = address or socket.gethostbyname(socket.gethostname())
        self.device = device
        self.backend = backend
        """``None``: per the device (:func:`meridian.workers.distributed.devices.backend_for`)."""
        self.collective_timeout_s = collective_timeout_s
        self.probe_port = probe_port
        """The agent's liveness port (:mod:`meridian.workers.elastic.liveness`), sent with every join."""
        self.epoch = 0
        self._store: dist.TCPStore | None = store
        """The store server this worker hosts from its join until its epoch forms (see the module's note); one a
        standby hosted while it waited (:func:`prehost_store`) serves its first join."""

    def join(self, *, last_step: int, timeout_s: float, on_wait: Callable[[str], None] | None = None,
             snapshot_every: int = 1) -> Assignment:
        """Block until the coordinator puts this worker in an epoch newer than the one it knows."""
        deadline = time.monotonic() + timeout_s
        reason = ""
        # One store for every poll of this join: the epoch can form between two polls, and the others are then
        # told the port of the poll before — a rank 0 hosting its store on a newer one would never be reached.
        if self._store is None:
            self._store = host_store(self.address, self._timeout)
        else:  # hosted before this process knew the job's timeout, or left from a join that timed out
            self._store.set_timeout(self._timeout)
        request = JoinRequest(worker_id=self.worker_id, datacenter=self.datacenter, node_id=self.node_id,
                              address=self.address, port=self._store.port, last_step=last_step,
                              snapshot_every=snapshot_every, probe_port=self.probe_port)  # fmt: skip
        while True:
            reply = self.call("join", request, self.epoch)
            if isinstance(reply, Finished):
                self._store = None
                raise JobFinished()
            if isinstance(reply, Assignment):
                self.epoch = reply.epoch
                return reply
            if not isinstance(reply, Waiting):
                raise TypeError(f"the coordinator answered a join with {reply!r}")
            if reply.reason != reason and on_wait is not None:
                on_wait(reply.reason)
            reason = reply.reason
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"no epoch formed within {timeout_s:.0f} s: {reason}")
            if reply.retry_after_s > 0:
                time.sleep(reply.retry_after_s)

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.collective_timeout_s)

    def form(self, a: Assignment) -> None:
        """Create this epoch's default process group over rank 0's store (hosted since its join): per device
        type on a GPU (``cpu:gloo,cuda:nccl``), bound to this rank's device (``set_device`` and ``device_id``)."""
        kwargs = init_kwargs(bind_device(self.device))
        if self.backend is not None:
            kwargs["backend"] = self.backend
        hosted, self._store = self._store, None  # the group holds the store from here; teardown frees it
        if a.rank == 0:
            if hosted is None or hosted.port != a.master_port:
                raise StoreNotHosted(f"epoch {a.epoch} names store port {a.master_port}, this rank hosts "
                                     f"{hosted.port if hosted else 'none'}")  # fmt: skip
            store = hosted
        else:
            del hosted  # a peer's store serves this epoch: this one closes
            store = dist.TCPStore(a.master_addr, a.master_port, is_master=False, timeout=self._timeout)
        if not self.device.startswith("cuda"):  # gloo's address exchange, a round trip less per peer and group
            store = PrefetchingStore(store)
            # A store written in Python must outlive every group made over it: torch keeps only its C++ half, and
            # the next group's first call found no Python method behind it ("Not implemented").
            Rendezvous._group_store = store
        dist.init_process_group(store=store, rank=a.rank, world_size=a.world_size, timeout=self._timeout, **kwargs)

    def finish(self) -> None:
        self.call("finish", self.worker_id)

    def suspended(self, step: int) -> None:
        """This rank wrote its part of the suspended job's checkpoint of ``step``."""
        self.call("suspended", self.worker_id, step)

    def pending_change(self) -> bool:
        return bool(self.call("pending_change", self.epoch))

    @staticmethod
    def teardown() -> None:
        """Destroy every process group of this rank (closing its sockets, which fails its peers fast)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        Rendezvous._group_store = None
