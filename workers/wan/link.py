"""Shared link state of the WAN emulator: small files in ``/dev/shm`` that every process of a job reads
and updates under ``fcntl.flock``, so that ranks in different processes queue on one emulated link.

What it is for: the time each DC-pair link is next free (:class:`SharedLink`) and the agreed completion time
of each collective (:class:`Ledger`); the model that uses them is in :mod:`meridian.workers.wan.collectives`. What it must
never do: trust a file left by another boot or an earlier run (stale state may only make the emulator slower,
never faster), or hold one file's lock while waiting for another file's lock held elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import struct
import threading
import uuid
from collections.abc import Callable, Iterator

import torch.distributed as dist

from meridian.workers.wan.file_names import FILE_PREFIX, key_stem, safe_name, shm_dir  # noqa: F401 - the names the emulator's files take

KEY_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# Ledger slots are reused modulo this many collectives per group. Ranks of a group are never more than a
# few collectives apart (each completes only when all ranks issued it), so a slot is long settled by reuse.
_LEDGER_SLOTS = 512
# A ledger record is trusted only if it was booked within this long of this rank's own completion: real
# collectives finish within milliseconds of each other, a record left by an earlier run with the same key
# does not (and a wrongly rejected record only books the links twice, i.e. errs slow, never fast).
_LEDGER_MATCH_S = 10.0


def _read_boot_id() -> bytes:
    # CLOCK_MONOTONIC restarts at boot: link files that outlived a reboot (the temp-dir fallback survives
    # one) must not be read as "busy until far in the future".
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


_BOOT_ID = _read_boot_id()


def cleanup(key: str, directory: str | None = None) -> int:
    """Unlink every shared file of ``key``; returns how many. Call once, after every rank is done."""
    directory = directory or shm_dir()
    removed = 0
    for name in os.listdir(directory):
        if name.startswith(f"{FILE_PREFIX}{key}+"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed += 1
    return removed


class NotOneHost(RuntimeError):
    """The ranks of a job with an emulated WAN run on more than one host."""


def host_identity() -> str:
    """This machine, as the shared link files know it: its boot id (one kernel, one ``/dev/shm``)."""
    return _BOOT_ID.hex()


def check_one_host(hosts: list[str]) -> None:
    """Refuse an emulated WAN whose ranks are on different hosts: its link state lives in one host's
    ``/dev/shm``, so ranks elsewhere would each book a link of their own and never wait for each other."""
    distinct = list(dict.fromkeys(hosts))
    if len(distinct) > 1:
        ranks = {h: [r for r, x in enumerate(hosts) if x == h] for h in distinct}
        raise NotOneHost(
            f"the application WAN emulator (TrainConfig.wan) needs every rank on one host, but the ranks run on "
            f"{len(distinct)} hosts (ranks by host: {list(ranks.values())}); its link state lives in one host's "
            "/dev/shm. Across hosts, emulate the WAN with the network lab (`meridian lab up`: real network "
            "namespaces and a delayed link) or train over the real links (leave `wan` unset)"
        )


def agree_key(prefix: str) -> str:
    """A key unique to this run and equal on every rank: rank 0's ``prefix`` plus random hex, exchanged once
    over the world group. Fresh keys keep a restarted job off the files of the run before it. Raises
    :class:`NotOneHost` (on every rank alike) when the ranks are not all on this host."""
    mine = (f"{key_stem(prefix)}.{secrets.token_hex(4)}" if dist.get_rank() == 0 else None, host_identity())
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, mine)
    check_one_host([host for _, host in box])
    return str(box[0][0])


class _SharedFile:
    """A small fixed-layout file shared by every process of the job on this host, starting with the boot id.

    ``flock`` excludes other processes; the thread lock excludes other threads of this process, since flock
    locks belong to the open file description and so do not exclude threads sharing the descriptor (gloo
    runs completion callbacks on its own threads)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._thread_lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if os.pread(self._fd, 16, 0) != _BOOT_ID:  # new, or stale from another boot: start empty
                    os.ftruncate(self._fd, 0)
                    os.pwrite(self._fd, _BOOT_ID, 0)
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self, offset: int, fmt: struct.Struct) -> tuple | None:
        data = os.pread(self._fd, fmt.size, 16 + offset)
        return fmt.unpack(data) if len(data) == fmt.size else None

    def write(self, offset: int, fmt: struct.Struct, *values: object) -> None:
        os.pwrite(self._fd, fmt.pack(*values), 16 + offset)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class SharedLink:
    """One direction of one DC pair: the time it is next free, shared by every process on this host."""

    _FREE_AT = struct.Struct("<d")

    def __init__(self, path: str, bytes_per_s: float) -> None:
        self._file = _SharedFile(path)
        self.bytes_per_s = bytes_per_s

    def reserve(self, wire_bytes: float, start: float) -> float:
        """Book ``wire_bytes`` from ``start`` (or when the link frees up); return when its last byte leaves."""
        with self._file.locked():
            rec = self._file.read(0, self._FREE_AT)
            begin = max(start, rec[0] if rec else start)
            end = begin + wire_bytes / self.bytes_per_s
            self._file.write(0, self._FREE_AT, end)
        return end

    def free_at(self) -> float:
        with self._file.locked():
            rec = self._file.read(0, self._FREE_AT)
        return rec[0] if rec else float("-inf")

    def close(self) -> None:
        self._file.close()


class Ledger:
    """Completion times of one group's collectives, so every rank of a collective uses the same one."""

    _SLOT = struct.Struct("<qdd")  # sequence number, start, ready

    def __init__(self, path: str) -> None:
        self._file = _SharedFile(path)

    def settle(self, seq: int, start: float, book: Callable[[float], float], *, in_flight: int = 0) -> float:
        """Completion of collective ``seq``: the recorded one, else ``book(begin)``'s, recorded. With
        ``in_flight`` > 0 the collective begins no earlier than collective ``seq - in_flight`` completed (the
        group runs that many at once); 0: no such limit."""
        offset = (seq % _LEDGER_SLOTS) * self._SLOT.size
        with self._file.locked():
            rec = self._file.read(offset, self._SLOT)
            if rec and rec[0] == seq and abs(rec[1] - start) < _LEDGER_MATCH_S:
                return rec[2]
            begin = start
            if in_flight > 0 and seq >= in_flight:
                before = self._file.read(((seq - in_flight) % _LEDGER_SLOTS) * self._SLOT.size, self._SLOT)
                if before and before[0] == seq - in_flight and abs(before[1] - start) < _LEDGER_MATCH_S:
                    begin = max(start, before[2])
            ready = book(begin)
            self._file.write(offset, self._SLOT, seq, start, ready)
        return ready

    def recorded(self, seq: int) -> float | None:
        """The completion recorded for collective ``seq``, if any."""
        with self._file.locked():
            rec = self._file.read((seq % _LEDGER_SLOTS) * self._SLOT.size, self._SLOT)
        return rec[2] if rec and rec[0] == seq else None

    def close(self) -> None:
        self._file.close()
