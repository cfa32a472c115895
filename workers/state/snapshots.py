"""The newest few shards of this rank's training state, kept where the next training process finds them.

A rank appends its shard every k steps (``TrainConfig.snapshot_every``, widened as measured with
``snapshot_adaptive``: :func:`snapshot_interval`); after a failure the survivors pool the shards of the step they all
completed (:func:`meridian.workers.state.replica_state.assemble`). In a RAM-backed folder (``/dev/shm``) the
shards outlive the training process, which the agent restarts after every peer failure.

On a GPU the shard's tensors are pinned host buffers still being filled by non-blocking copies: the caller
passes an event recorded after them (``ready``), and the file is written on a writer thread once the event
has completed, off the training thread's critical path. Every read waits for that write first. On CPU the
write stays synchronous.

A file holds the shard packed (:func:`~meridian.workers.state.replica_state.pack`: a small description and one
flat tensor), not the shard object with its tensor per piece and moment. Measured on a 50-piece shard of
nano's size (two idle cores): written in 0.5 ms instead of 2.5, read in 0.3 ms instead of 4.8. Every CPU step
paid the write, and a re-formed epoch's restore the read (4-9 ms on a busy machine).

The file is not ``torch.save``'s zip: ``MRDS``, the description's length (8 bytes, little-endian), the pickled
description, then the fp32 numbers raw, each piece's tensors written one after another from where they are
(no concatenated copy, no CRC over the numbers) and read back straight into one flat tensor. A profile of a
training process of ``bench recovery``'s job (nano, 2 + 2 workers, a snapshot every step, two busy cores) had
14% of its training thread's samples in the snapshot, most of them in ``torch.save``. On a quiet machine, for a
nano-sized shard of 29 parameters with both moments, this store and the ``torch.save`` one alternating in one
process (600 writes and 300 reads each, medians): a write took 0.77 ms instead of 1.30, a read 0.17 ms instead
of 0.46. A file ``torch.save`` wrote (an older Meridian's) still reads.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from meridian.workers.state.replica_state import LocalShard, pack, pack_parts, unpack

MAGIC = b"MRDS"
"""The first bytes of a snapshot file in the raw format (see the module's note)."""

SNAPSHOT_MAX_SHARE = 0.05
"""An adaptive cadence keeps what snapshots cost the training loop under this share of its step time."""
SNAPSHOT_FREE_S = 0.01
"""A snapshot that holds the loop up for less than this is taken every step regardless (a small model's)."""
WRITER_MARGIN = 1.25
"""The steps between two snapshots outlast the background write of one by this factor, so the next snapshot
never waits for the last one's write."""


def snapshot_interval(loop_s: float, background_s: float, step_s: float) -> int:
    """The fewest steps between snapshots such that a snapshot, which holds the training loop up for ``loop_s``
    (a CPU's synchronous write; not a wait for the last write, which only says snapshots come too often) and
    keeps a writer busy for ``background_s`` (a GPU's copies and file write, off the loop), costs the loop at most
    ``SNAPSHOT_MAX_SHARE`` of the steps' time and the writer is done before the next one. ``step_s``: a step's
    time without snapshots."""
    if step_s <= 0:
        return 1
    k = math.ceil(WRITER_MARGIN * background_s / step_s) if background_s > 0 else 1
    if loop_s > SNAPSHOT_FREE_S:
        k = max(k, math.ceil(loop_s / (SNAPSHOT_MAX_SHARE * step_s)))
    return max(1, k)


class SnapshotNotWritten(OSError):
    """A snapshot's file could not be written (its RAM folder is full: a container's small ``/dev/shm``). Raised
    on the training thread, also for a write on the writer thread (by the next call that waits for it): a
    snapshot missing without a word would leave a failure to resume from an older step, or the checkpoint."""


class SnapshotStore:
    """The newest ``keep`` shards, in memory (``directory=None``) or as files in a RAM-backed folder."""

    def __init__(self, keep: int, directory: str | None = None) -> None:
        self.keep = keep
        self.directory = Path(directory) if directory else None
        self._memory: list[LocalShard] = []
        self._writer: threading.Thread | None = None
        self._ahead: tuple[int, threading.Thread, list[Any]] | None = None
        """A read started by :meth:`read_ahead`: its step, its thread, and (once read) the packed shard."""
        self.write_s: list[float] = []
        """Each background write's seconds, from :meth:`append` to the shard kept (newest last, a few)."""
        self._failed: BaseException | None = None
        """The error of the writer thread's last write, raised by :meth:`wait`."""
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def _files(self) -> list[Path]:
        assert self.directory is not None
        return sorted(self.directory.glob("shard-*.pt"))

    def append(self, shard: LocalShard, ready: Any = None) -> float:
        """Keep ``shard``; ``ready``: a CUDA event after which its (pinned, non-blocking) copies are complete,
        to write it on a writer thread instead of now. Returns the seconds it waited for the write before it."""
        began = time.perf_counter()
        self.wait()
        self._ahead = None  # training went on: a read ahead that was not taken is not wanted
        waited_s = time.perf_counter() - began
        if ready is not None:
            self._writer = threading.Thread(target=self._append_when_ready, args=(shard, ready, time.perf_counter()),
                                            name="meridian-snapshot", daemon=True)  # fmt: skip
            self._writer.start()
            return waited_s
        self._append(shard)
        return waited_s

    def _append_when_ready(self, shard: LocalShard, ready: Any, since: float) -> None:
        try:
            ready.synchronize()
            self._append(shard)
        except BaseException as e:  # raised on the training thread by wait()
            self._failed = e
            return
        self.write_s = [*self.write_s[-2:], time.perf_counter() - since]

    def wait(self) -> None:
        """Until the shard being written (if any) is kept; raises the error its write failed with."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _append(self, shard: LocalShard) -> None:
        if self.directory is None:
            self._memory = [s for s in self._memory if s.step != shard.step][-(self.keep - 1) :] + [shard]
            return
        tmp = self.directory / f"partial-{shard.step:010d}.tmp"
        desc, tensors = pack_parts(shard)
        try:
            write_packed(tmp, desc, tensors)
            os.replace(tmp, self._path(shard.step))
        except OSError as e:
            tmp.unlink(missing_ok=True)  # what was written of it would hold the RAM the next snapshot needs
            raise SnapshotNotWritten(e.errno, self._not_written(shard.step, 4 * desc["numel"], e)) from e
        for old in self._files()[: -self.keep]:
            old.unlink(missing_ok=True)

    def _not_written(self, step: int, nbytes: int, error: OSError) -> str:
        assert self.directory is not None
        try:
            free = f"{_mib(shutil.disk_usage(self.directory).free)} free there"
        except OSError:
            free = "its free space unknown"
        return (f"the state snapshot of step {step} could not be written to {self.directory} "
                f"({error.strerror or error}; it needs {_mib(nbytes)}, {self.keep} such kept, "
                f"{free}): give that folder's filesystem more room (a container's /dev/shm: docker run "
                "--shm-size, or a memory-backed emptyDir on Kubernetes), or train on more workers so each "
                "holds a smaller shard")

    def read_ahead(self, step: int) -> None:
        """Start reading the file of ``step`` on a thread, for :meth:`get_packed` of that step to take. For a
        process about to block without the GIL (a new training process waiting for its epoch to form, which is
        when the newest snapshot is the one it will most likely resume from): measured on two busy cores, that
        process's first read took 4-11 ms on the re-formation's critical path. (Reading ahead while the process
        group formed, stop 41, competed with it for the GIL and lost more than it hid.)"""
        if self.directory is None or step <= 0:
            return
        self.wait()
        out: list[Any] = []
        path = self._path(step)

        def read() -> None:
            with contextlib.suppress(Exception):  # gone or half there: get_packed reads it (or not) itself
                out.append(self._read(path))

        thread = threading.Thread(target=read, name="meridian-snapshot-read", daemon=True)
        thread.start()
        self._ahead = (step, thread, out)

    def get(self, step: int) -> LocalShard | None:
        packed = self.get_packed(step)
        return None if packed is None else unpack(*packed)

    def get_packed(self, step: int) -> tuple[dict[str, Any], torch.Tensor] | None:
        """The shard of ``step`` as :func:`~meridian.workers.state.replica_state.pack` gives it (what a file holds:
        the survivors exchange it so, with no unpacking and packing again), or ``None``."""
        self.wait()
        if self.directory is None:
            shard = next((s for s in self._memory if s.step == step), None)
            return None if shard is None else pack(shard)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            ahead[1].join()
            if ahead[2]:
                return ahead[2][0]
        path = self._path(step)
        if not path.exists():
            return None
        return self._read(path)

    def _path(self, step: int) -> Path:
        assert self.directory is not None
        return self.directory / f"shard-{step:010d}.pt"

    @staticmethod
    def _read(path: Path) -> tuple[dict[str, Any], torch.Tensor]:
        packed = read_packed(path)
        if packed is not None:
            return packed
        kept = torch.load(path, weights_only=False)  # an older Meridian's file: torch.save's
        return pack(kept) if isinstance(kept, LocalShard) else kept  # (a shard object: older still)

    @property
    def last_step(self) -> int:
        self.wait()
        if self.directory is None:
            return self._memory[-1].step if self._memory else 0
        files = self._files()
        return int(files[-1].stem.split("-")[1]) if files else 0

    def discard_after(self, step: int) -> None:
        """Forget shards newer than ``step`` (an epoch resumed at ``step`` will train those steps again)."""
        self.wait()
        if self.directory is None:
            self._memory = [s for s in self._memory if s.step <= step]
            return
        for f in self._files():
            if int(f.stem.split("-")[1]) > step:
                f.unlink(missing_ok=True)

    def clear(self) -> None:
        self.wait()
        if self.directory is None:
            self._memory.clear()
            return
        for f in self._files():
            f.unlink(missing_ok=True)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes:,} bytes"


def write_packed(path: Path, desc: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    """Write a packed shard (its description and flat fp32 tensors, :func:`pack_parts`) to ``path`` in the raw
    format of the module's note."""
    head = pickle.dumps(desc)
    with open(path, "wb") as f:
        f.write(MAGIC + len(head).to_bytes(8, "little"))
        f.write(head)
        for t in tensors:
            f.write(memoryview(t.detach().contiguous().numpy()).cast("B"))


def read_packed(path: Path) -> tuple[dict[str, Any], torch.Tensor] | None:
    """The packed shard :func:`write_packed` wrote, its numbers in one flat tensor; ``None`` for a file in another
    format. A file cut short raises ``EOFError``."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 8)
        if len(start) < len(MAGIC) + 8 or start[: len(MAGIC)] != MAGIC:
            return None
        head = f.read(int.from_bytes(start[len(MAGIC) :], "little"))
        desc = pickle.loads(head)
        flat = torch.empty(desc["numel"], dtype=torch.float32)
        want = flat.numel() * flat.element_size()
        if want and f.readinto(memoryview(flat.numpy()).cast("B")) != want:
            raise EOFError(f"{path} holds fewer numbers than its description says ({desc['numel']})")
    return desc, flat
