"""Single-file checkpoints: the whole state in one ``state.pt``, written by one rank.

Jobs write sharded checkpoints instead (:mod:`meridian.workers.state.sharded_checkpoint`: every rank its own
shard, nothing gathered). This format remains so that checkpoints written by
earlier versions still resume and export. It holds the *full* model and optimizer
state, the step and a fingerprint, so it loads into any layout. ``<dir>`` is a local folder or an fsspec URL;
a save commits as :mod:`meridian.workers.state.storage` describes, so a crash mid-write never leaves a
checkpoint that looks complete.

Layout::

    <dir>/step-00000040/state.pt     model, optimizer, step, config fingerprint
    <dir>/latest                     "step-00000040"
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meridian.workers.state import storage

STATE_FILE = "state.pt"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    """Optimizer steps completed; training resumes at this step index."""
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    fingerprint: dict[str, Any]
    """What must match to resume (model shape, global batch, seed): a checkpoint of another job is refused."""


def save(directory: str, ckpt: Checkpoint, *, keep: int = 2) -> Path | str:
    """Write ``ckpt`` under ``directory`` (a folder or a URL); keep the newest ``keep`` checkpoints."""
    name = f"step-{ckpt.step:08d}"
    folder = storage.prepare(directory, name)
    if not storage.is_url(folder):
        Path(folder).mkdir()
    with storage.open_file(storage.join(folder, STATE_FILE), "wb") as f:
        torch.save({"step": ckpt.step, "model": ckpt.model, "optimizer": ckpt.optimizer,
                    "fingerprint": ckpt.fingerprint}, f)
    return publish(directory, folder, name, keep=keep)


def publish(root: str | Path, written: str | Path, name: str, *, keep: int) -> Path | str:
    """Make the complete folder ``written`` (:func:`storage.writing_folder`, its marker file written last) the
    checkpoint ``root/name``, point ``latest`` at it, and delete all but the newest ``keep`` checkpoints
    (:func:`storage.commit`). Both formats finish a save with this. The folder: a ``Path``, or the URL."""
    final = storage.commit(str(root), name, str(written), keep=keep)
    return final if storage.is_url(final) else Path(final)


def read_state(folder: str) -> dict[str, Any]:
    """What the checkpoint folder's ``state.pt`` holds (step, model, optimizer, fingerprint); a file cut short or
    garbled is a :class:`~meridian.workers.state.storage.CheckpointUnreadable` saying what to do."""
    try:
        with storage.open_file(storage.join(folder, STATE_FILE), "rb") as f:
            data = torch.load(f, map_location="cpu", weights_only=False)
        if not isinstance(data, dict) or not {"step", "model", "optimizer", "fingerprint"} <= data.keys():
            raise ValueError(f"{STATE_FILE} holds no Meridian checkpoint")
    except Exception as e:  # torch's own errors for a cut zip, unpickling errors, a URL's library's
        raise storage.unreadable(folder, e) from e
    return data


def load_latest(directory: str) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory``, or ``None`` if there is none."""
    name = storage.latest(directory)
    if name is None:
        return None
    data = read_state(storage.join(directory, name))
    return Checkpoint(step=data["step"], model=data["model"], optimizer=data["optimizer"],
                      fingerprint=data["fingerprint"])


def check_fingerprint(found: dict[str, Any], expected: dict[str, Any], directory: str) -> None:
    """A ``ValueError`` naming what differs, unless the checkpoint's fingerprint ``found`` is ``expected``."""
    if found != expected:
        diff = {k: (found.get(k), v) for k, v in expected.items() if found.get(k) != v}
        raise ValueError(
            f"checkpoint in {directory} belongs to a different job (checkpoint vs job: {diff}); "
            "point the job at an empty checkpoint directory"
        )
