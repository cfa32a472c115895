"""What ``meridian data prepare`` writes next to its shards, and how a job reads it back; torch-free.

A prepared dataset is a directory::

    manifest.json          this file's :class:`Manifest` (written last: a directory without it is unfinished)
    tokenizer.json         the Hugging Face tokenizer the tokens were made with
    train-00000.bin ...    the train split's tokens, raw little-endian ``uint16`` or ``uint32``, one stream
    train-docs.npy         int64 start offset of every document in that stream
    val-00000.bin ...      the validation split, the same way

Documents are concatenated in input order, each followed by the tokenizer's end-of-text token (when it has
one), and every ``round(1 / val_fraction)``-th document goes to the validation split.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from meridian.workers.contracts.fields import from_plain, to_plain

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Shard:
    file: str
    tokens: int


@dataclass(frozen=True)
class Split:
    tokens: int = 0
    documents: int = 0
    shards: tuple[Shard, ...] = ()
    doc_index: str = ""
    """``.npy`` file of the documents' start offsets in the split's token stream."""


@dataclass(frozen=True)
class InputFile:
    path: str
    sha256: str
    bytes: int
    documents: int = 0


@dataclass(frozen=True)
class Manifest:
    key: str
    """Hash of the inputs' contents and every option: a rerun with the same key reuses the directory."""
    vocab_size: int
    dtype: str
    """``uint16`` when every token id fits, else ``uint32``."""
    tokenizer_sha256: str
    tokenizer_trained: bool
    eos_id: int | None
    text_field: str
    val_fraction: float
    train: Split
    val: Split
    inputs: tuple[InputFile, ...] = ()
    tokenizer_file: str = "tokenizer.json"
    format: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.train.tokens + self.val.tokens

    def split(self, name: str) -> Split:
        if name == "train":
            return self.train
        if name in ("val", "eval", "validation"):
            return self.val
        raise ValueError(f"unknown split {name!r}; use 'train' or 'val'")

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)


def read_manifest(directory: str) -> Manifest:
    """The manifest of a prepared dataset; ``ValueError`` naming the directory when there is none."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{directory!r} is not a prepared dataset (no {MANIFEST}); run `meridian data prepare "
                         f"... --out {directory}` first") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} cannot be read: {e}") from None
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path!r} has format {data.get('format')!r}, this Meridian reads {FORMAT_VERSION}; "
                         "prepare the dataset again")
    return from_plain(Manifest, data)


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Atomically: a reader sees the old manifest or the new one, never half of one."""
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest.to_dict(), f, indent=2)
    os.replace(tmp, os.path.join(directory, MANIFEST))
