"""Text corpora a benchmark can train on beyond the built-in Python Language Reference (465 KB).

The built-in text is small: ``tiny`` at 2,048 steps of 16 samples of 128 bytes reads its training part nine
times over, and at 8,192 steps per-step sync overfits it. ``python-stdlib`` is the Python standard library's own
source, present on every machine that runs the bench (about 12 MB once its tests and generated tables are left
out): its ``.py`` files in an order fixed by a seed (so the held-out tail, the last 5 % of the bytes a job reads,
mixes modules), joined up to ``max_bytes``.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass

from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.source import split_bytes
from meridian.workers.data.text import BUILTIN_PYTHON_REFERENCE, load_text

PYTHON_STDLIB = "python-stdlib"
CHOICES_HELP = (f"{BUILTIN_PYTHON_REFERENCE!r} (the default), {PYTHON_STDLIB!r} (this Python's standard library "
                "source, written to a temporary file) or an absolute path to a UTF-8 text file")  # fmt: skip


# Installed packages; the test suite (17 MB, much of it data); generated codec tables; the built-in text itself.
LEFT_OUT = ("site-packages", "dist-packages", "test", "encodings", "pydoc_data")


@dataclass(frozen=True)
class Corpus:
    source: str
    """What a job's ``data.source`` names."""
    name: str
    """What the report calls it."""
    train_bytes: int
    """Bytes of its training part (one byte is one token)."""
    sha256: str


def python_stdlib_text(max_bytes: int, seed: int = 0) -> bytes:
    """The standard library's ``.py`` files (but those under :data:`LEFT_OUT`), in an order fixed by ``seed``, joined up
    to ``max_bytes``; only files that decode as UTF-8."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in LEFT_OUT or d != root)
        paths += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    random.Random(seed).shuffle(paths)
    out, size = [], 0
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


def prepare(source: str, max_bytes: int, directory: str) -> Corpus:
    """The corpus ``source`` names (the stdlib's written under ``directory``), read as a job reads it."""
    name = source
    if source == PYTHON_STDLIB:
        source = os.path.join(directory, "python-stdlib.txt")
        with open(source, "wb") as f:
            f.write(python_stdlib_text(max_bytes))
    elif source != BUILTIN_PYTHON_REFERENCE and not os.path.isabs(source):
        raise ValueError(f"--data-source must be {CHOICES_HELP}; got {source!r}")
    text = load_text(DataConfig(source=source, max_bytes=max_bytes))
    return Corpus(source=source, name=name, train_bytes=split_bytes(len(text), "train")[1],
                  sha256=hashlib.sha256(text).hexdigest())  # fmt: skip
