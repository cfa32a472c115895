"""The newest few shards of this rank's training state, kept where the next training process finds them.

A rank appends its shard after every step; after a failure the survivors pool the shards of the step they all
completed (:func:`meridian.workers.state.replica_state.assemble`). In a RAM-backed folder (``/dev/shm``) the
shards outlive the training process, which the agent restarts after every peer failure.

On a GPU the shard's tensors are pinned host buffers still being filled by non-blocking copies: the caller
passes an event recorded after them (``ready``), and the file is written on a writer thread once the event
has completed, off the training thread's critical path. Every read waits for that write first. On CPU the
write stays synchronous.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from meridian.workers.state.replica_state import LocalShard


class SnapshotStore:
    """The newest ``keep`` shards, in memory (``directory=None``) or as files in a RAM-backed folder."""

    def __init__(self, keep: int, directory: str | None = None) -> None:
        self.keep = keep
        self.directory = Path(directory) if directory else None
        self._memory: list[LocalShard] = []
        self._writer: threading.Thread | None = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def _files(self) -> list[Path]:
        assert self.directory is not None
        return sorted(self.directory.glob("shard-*.pt"))

    def append(self, shard: LocalShard, ready: Any = None) -> None:
        """Keep ``shard``; ``ready``: a CUDA event after which its (pinned, non-blocking) copies are complete,
        to write it on a writer thread instead of now."""
        self.wait()
        if ready is not None:
            self._writer = threading.Thread(target=self._append_when_ready, args=(shard, ready),
                                            name="meridian-snapshot", daemon=True)  # fmt: skip
            self._writer.start()
            return
        self._append(shard)

    def _append_when_ready(self, shard: LocalShard, ready: Any) -> None:
        ready.synchronize()
        self._append(shard)

    def wait(self) -> None:
        """Until the shard being written (if any) is kept."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _append(self, shard: LocalShard) -> None:
        if self.directory is None:
            self._memory = [s for s in self._memory if s.step != shard.step][-(self.keep - 1) :] + [shard]
            return
        tmp = self.directory / f"partial-{shard.step:010d}.tmp"
        torch.save(shard, tmp)
        os.replace(tmp, self.directory / f"shard-{shard.step:010d}.pt")
        for old in self._files()[: -self.keep]:
            old.unlink(missing_ok=True)

    def get(self, step: int) -> LocalShard | None:
        self.wait()
        if self.directory is None:
            return next((s for s in self._memory if s.step == step), None)
        path = self.directory / f"shard-{step:010d}.pt"
        return torch.load(path, weights_only=False) if path.exists() else None

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

