"""An elastic job's durable checkpoints: every rank writes its own shard in the background, and any later
layout loads them.

:class:`Checkpointer` hands the rank's shard of the step (the in-memory snapshot the loop already took, or a
fresh copy of what the rank owns) to a writer thread, which saves it with
:func:`~meridian.workers.state.sharded_checkpoint.save_shard` over a gloo group of its own: the shard is a host
copy on every device, and a separate group keeps the save's collectives apart from the training's, which run
meanwhile on the epoch's groups. The step pays only for that copy (nothing when the snapshot is reused).

:func:`restore_latest` loads the newest checkpoint of either format into a model and its engine: the sharded
one (each rank reading the weights and only its own optimizer state), or a single-file one
(:mod:`meridian.workers.state.checkpoint`, written by older versions).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meridian.workers.state import checkpoint as single_file
from meridian.workers.state import storage
from meridian.workers.state.replica_state import LocalShard, assemble
from meridian.workers.state.sharded_checkpoint import (
    first_failure,
    is_sharded,
    open_checkpoint,
    read_ranges,
    read_weights,
    save_shard,
    stored_nbytes,
)
from meridian.workers.sync.engine import GradientSync

GROUP_TIMEOUT = datetime.timedelta(minutes=5)
"""A save whose peer died fails after this long, on its own thread, leaving only an uncommitted folder (never
read: :mod:`meridian.workers.state.storage`)."""


class CheckpointNotWritten(RuntimeError):
    """A durable checkpoint's save failed (a full disk, storage that refuses the write): the job stops instead of
    training on without the checkpoint it asked for (its final one: the weights it keeps and exports)."""


@dataclass
class _Save:
    """One save on the writer thread: its step, and the error it ended with."""

    step: int
    thread: threading.Thread | None = None
    error: BaseException | None = None


class Checkpointer:
    """One save at a time, in step order, each on a background thread; every rank of the epoch calls
    :meth:`save` at the same steps. A save that failed is raised by the next :meth:`wait` (which :meth:`save`
    and the end of the job call) as :class:`CheckpointNotWritten`, or as the collective's own error when a
    peer went away (the epoch re-forms and saves again)."""

    def __init__(self, directory: str, fingerprint: dict[str, Any]) -> None:
        self.directory, self.fingerprint = directory, fingerprint
        self._save: _Save | None = None
        self._group: Any = None
        self.last_error: BaseException | None = None
        """The error of the last save that failed, abandoned ones included (raised by :meth:`wait` unless
        abandoned)."""
        self.call_s: list[float] = []
        """Seconds the training thread spent in each :meth:`save` (waiting for the previous save included)."""
        self.write_s: list[float] = []
        """Seconds each completed write took on the writer thread."""

    def new_epoch(self) -> None:
        """The epoch's groups are new: a save still running in the last one is abandoned with its group (it
        fails on its own; its folder stays uncommitted and is never read, and its error is not raised)."""
        if self._save is not None and self._save.thread is not None and self._save.thread.is_alive():
            print("meridian: a checkpoint save of the previous epoch is abandoned", file=sys.stderr, flush=True)
        self._save, self._group = None, None

    def save(self, shard: LocalShard, *, rank: int, datacenter: str, shapes: dict[str, torch.Size],
             ready: Any = None) -> None:
        """Start writing ``shard``; ``ready``: a CUDA event after which its host copies are complete. Raises
        the error of the previous save, if it failed (:meth:`wait`)."""
        t0 = time.perf_counter()
        self.wait()
        if self._group is None:  # collective: every rank reaches its first save at the same step
            self._group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        save = _Save(shard.step)
        args = (save, shard, rank, datacenter, shapes, ready, self._group)
        save.thread = threading.Thread(target=self._write, args=args, name="meridian-checkpoint", daemon=True)
        self._save = save
        save.thread.start()
        self.call_s.append(time.perf_counter() - t0)

    def _write(self, save: _Save, shard: LocalShard, rank: int, datacenter: str, shapes: dict[str, torch.Size],
               ready: Any, group: Any) -> None:
        t0 = time.perf_counter()
        try:
            if ready is not None:
                ready.synchronize()
            save_shard(self.directory, shard, rank=rank, datacenter=datacenter, shapes=shapes,
                       fingerprint=self.fingerprint, group=group)
            self.write_s.append(time.perf_counter() - t0)
        except BaseException as e:  # raised on the training thread by wait() (a peer's death: the epoch re-forms)
            save.error = self.last_error = e
            print(f"meridian: checkpoint of step {shard.step} not written: {first_failure(e)}", file=sys.stderr,
                  flush=True)

    def wait(self) -> None:
        """Until the save in flight (if any) is done; raises its error if it failed (once)."""
        save, self._save = self._save, None
        if save is None:
            return
        if save.thread is not None:
            save.thread.join()
        if save.error is None:
            return
        cause = first_failure(save.error)
        if isinstance(cause, getattr(dist, "DistError", ())):  # a peer went away mid-save: as the training's own
            raise cause
        raise CheckpointNotWritten(
            f"the durable checkpoint of step {save.step} was not written to {self.directory} "
            f"({type(cause).__name__}: {cause}); make room there or fix what refused the write (its permissions; "
            "for a URL, its credentials and endpoint): the job stops rather than train on without the checkpoint "
            "it was asked to keep"
        ) from save.error


@dataclass(frozen=True)
class Restored:
    step: int
    """Steps the checkpoint holds; training goes on at this step."""
    bytes_read: int
    """Bytes of tensors this rank read: the whole weights and only the optimizer state it holds."""
    bytes_stored: int
    """Bytes of tensors in the checkpoint (every rank reading all of them is what a sharded load avoids)."""


def restore_latest(directory: str, expected: dict[str, Any], model: nn.Module, engine: GradientSync) -> Restored | None:
    """Load the newest checkpoint in ``directory`` (either format) into ``model`` and ``engine``; ``None`` if
    there is none. A checkpoint of another job (``expected`` fingerprint differs) is a ``ValueError``."""
    name = storage.latest(directory)  # a folder or a URL
    if name is None:
        return None
    return restore_from(storage.join(directory, name), expected, model, engine)


def restore_from(path: str, expected: dict[str, Any], model: nn.Module, engine: GradientSync, *,
                 optimizer: bool = True) -> Restored:
    """Load the checkpoint folder ``path`` (either format) into ``model`` and ``engine``; a ``ValueError`` if its
    fingerprint is not ``expected``. Without ``optimizer`` only the weights load and the engine's optimizer
    state starts afresh (AdamW's step 0, no moments, no outer state): a new phase from another job's weights.

    From a sharded checkpoint every rank reads the whole weights, but of the optimizer state only the ranges
    its engine holds (:meth:`~meridian.workers.sync.engine.GradientSync.owned_ranges`): with AdamW sharded
    N ways in a DC, a rank reads (1 + 2/N)/3 of the checkpoint. No collective; any layout reads any other's."""
    if not is_sharded(path):
        data = single_file.read_state(path)
        single_file.check_fingerprint(data["fingerprint"], expected, path)
        load_weights(model, engine, data["model"])
        if optimizer:
            engine.load_optimizer_state(data["optimizer"])
        size = storage.size(storage.join(path, single_file.STATE_FILE))
        return Restored(data["step"], size, size)
    ck = open_checkpoint(path)
    # (stored as JSON: tuples become lists)
    single_file.check_fingerprint(ck.fingerprint, json.loads(json.dumps(expected)), path)
    owned = engine.owned_ranges()
    if owned is None:  # the engine holds the whole state
        shard = read_ranges(ck, [(n, 0, s.numel()) for n, s in ck.shapes.items()], state=optimizer)
        params, state = assemble([shard], ck.shapes)
        load_weights(model, engine, params)
        if optimizer:
            engine.load_optimizer_state(state)
        return Restored(ck.step, shard.nbytes, stored_nbytes(ck))
    weights = read_weights(ck)
    load_weights(model, engine, weights)
    # the moments and outer state (values are views of weights); without them AdamW starts at step 0
    shard = read_ranges(ck, owned, weights=weights, state=optimizer)
    engine.load_local_shard(shard if optimizer else dataclasses.replace(shard, adam_step=0))
    values = sum(t.numel() * t.element_size() for t in weights.values())
    return Restored(ck.step, values + shard.nbytes - sum(p.value.numel() * 4 for p in shard.pieces),
                    stored_nbytes(ck))


def load_weights(model: nn.Module, engine: GradientSync, params: dict[str, torch.Tensor]) -> None:
    """Copy whole parameters into ``model`` once the engine's communication in flight has finished."""
    engine.synchronize()
    engine.load_weights(model, params)
