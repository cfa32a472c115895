"""Single-file checkpoints: the whole state in one ``state.pt``, written by one rank.

Jobs write sharded checkpoints instead (:mod:`meridian.workers.state.sharded_checkpoint`: every rank its own
shard, nothing gathered; a tensor/pipeline-parallel job's final weights too,
:mod:`meridian.workers.state.model_parallel_weights`). This format remains so that checkpoints written by
earlier versions still resume and export. It holds the *full* model and optimizer
state, the step and a fingerprint, so it loads into any layout. Files land in a temporary folder that is
renamed into place, so a crash mid-write never leaves a checkpoint that looks complete.

Layout on disk::

    <dir>/step-00000040/state.pt     model, optimizer, step, config fingerprint
    <dir>/latest                     "step-00000040"
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    """Optimizer steps completed; training resumes at this step index."""
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    fingerprint: dict[str, Any]
    """What must match to resume (model shape, global batch, seed): a checkpoint of another job is refused."""


def save(directory: str, ckpt: Checkpoint, *, keep: int = 2) -> Path:
    """Write ``ckpt`` atomically under ``directory``; keep the newest ``keep`` checkpoints."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{ckpt.step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    torch.save({"step": ckpt.step, "model": ckpt.model, "optimizer": ckpt.optimizer,
                "fingerprint": ckpt.fingerprint}, tmp / STATE_FILE)
    return publish(root, tmp, name, keep=keep)


def publish(root: Path, written: Path, name: str, *, keep: int) -> Path:
    """Make the complete folder ``written`` the checkpoint ``root/name`` (a rename, so it appears whole or not
    at all), point ``latest`` at it the same way, and delete all but the newest ``keep`` checkpoints. Both
    formats finish a save with this."""
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(written, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest(directory: str) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory``, or ``None`` if there is none."""
    root = Path(directory)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip() / STATE_FILE
    data = torch.load(path, map_location="cpu", weights_only=False)
    return Checkpoint(step=data["step"], model=data["model"], optimizer=data["optimizer"],
                      fingerprint=data["fingerprint"])


def check_fingerprint(ckpt: Checkpoint, expected: dict[str, Any], directory: str) -> None:
    if ckpt.fingerprint != expected:
        diff = {k: (ckpt.fingerprint.get(k), v) for k, v in expected.items() if ckpt.fingerprint.get(k) != v}
        raise ValueError(
            f"checkpoint in {directory} belongs to a different job (checkpoint vs job: {diff}); "
            "point the job at an empty checkpoint directory"
        )
