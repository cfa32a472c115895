"""What ``meridian data prepare`` writes next to its shards, and how a job reads it back; torch-free.

A prepared dataset is a directory::

    manifest.json          this file's :class:`Manifest` (written last: a directory without it is unfinished)
    tokenizer.json         the Hugging Face tokenizer the tokens were made with
    train-00000.bin ...    the train split's tokens, raw little-endian ``uint16`` or ``uint32``, one stream
    train-docs.npy         int64 start offset of every document in that stream
    val-00000.bin ...      the validation split, the same way

Documents are concatenated in input order, each followed by the tokenizer's end-of-text token (when it has
one), and every ``round(1 / val_fraction)``-th document goes to the validation split.

Every file a manifest names must be a plain name inside its directory (no ``/``, no ``..``) and is opened
without following a symlink (:func:`open_dataset_file`): the service admits a dataset by its directory, under
its data roots, so a manifest must not be able to point a job at a file outside them.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from meridian.workers.contracts.config import DataPin
from meridian.workers.contracts.fields import from_plain, to_plain
from meridian.workers.contracts.regular_files import NotRegularFile, open_regular

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Shard:
    file: str
    tokens: int
    sha256: str = ""
    """SHA-256 of the shard file's bytes, as written (empty in datasets prepared before it was recorded: such a
    dataset trains from a path, not from a URL, whose copies are checked against it)."""


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
    """Embedding rows the token ids need: the tokenizer's largest id + 1 (its token count when ids have no holes)."""
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

    def files(self) -> list[tuple[str, str]]:
        """``(what, name)`` of every file this manifest names, for the checks and messages."""
        named = [("tokenizer_file", self.tokenizer_file)]
        for split, s in (("train", self.train), ("val", self.val)):
            named += [(f"{split} shard", sh.file) for sh in s.shards]
            if s.doc_index:
                named.append((f"{split} doc_index", s.doc_index))
        return named


def read_manifest(directory: str) -> Manifest:
    """The manifest of a prepared dataset directory (one named by URL: :func:`meridian.workers.data.remote.
    manifest_of`); ``ValueError`` naming the directory when there is none."""
    path = os.path.join(directory, MANIFEST)
    try:  # like every file of the dataset: a regular file, not a symlink, opened non-blocking (a pipe, a link to
        # /dev/zero, would hang the reader, the service's request with it)
        fd = open_regular(path)
    except FileNotFoundError:
        raise ValueError(f"{directory!r} is not a prepared dataset (no {MANIFEST}); run `meridian data prepare "
                         f"... --out {directory}` first") from None
    except OSError as e:
        raise ValueError(f"{path!r} cannot be read ({e.strerror}); it must be a regular file, not a symlink") from None
    except NotRegularFile:
        raise ValueError(f"{path!r} is not a regular file; prepare the dataset again with `meridian data "
                         "prepare`") from None
    try:
        with os.fdopen(fd, "rb") as f:
            return parse_manifest(f.read(), path)
    except OSError as e:
        raise ValueError(f"{path!r} cannot be read: {e}") from None


def is_url(location: str) -> bool:
    """A dataset named by URL (``s3://bucket/prefix``, ``file:///path``) rather than by a local path."""
    return "://" in location


def parse_manifest(text: bytes, path: str) -> Manifest:
    """A manifest from the bytes of ``path``'s ``manifest.json``, checked as :func:`read_manifest` checks it."""
    try:
        data = json.loads(text.decode("utf-8"))
    except ValueError as e:  # not JSON, not UTF-8
        raise ValueError(f"{path!r} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} holds a JSON {type(data).__name__}, not a dataset manifest; prepare the dataset "
                         "again with `meridian data prepare`")
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path!r} has format {data.get('format')!r}, this Meridian reads {FORMAT_VERSION}; "
                         "prepare the dataset again")
    try:
        manifest = from_plain(Manifest, data)
    except (TypeError, ValueError, AttributeError, KeyError) as e:  # fields missing, unknown, or of another shape
        raise ValueError(f"{path!r} is not a whole dataset manifest ({e}); prepare the dataset again with "
                         "`meridian data prepare`") from None
    for what, name in manifest.files():
        if not is_plain_name(name):
            raise ValueError(f"{path!r} names {what} {name!r}, which is not a plain file name inside the dataset "
                             "directory (no '/', no '..'); prepare the dataset again with `meridian data prepare`")
    wrong = _wrong_field(manifest)
    if wrong:
        raise ValueError(f"{path!r} has {wrong}; prepare the dataset again with `meridian data prepare`")
    return manifest


DTYPES = {"uint16": 2, "uint32": 4}
"""What a shard's tokens may be stored as, and their size in bytes."""


def check_shard_size(directory: str, manifest: Manifest, shard: Shard, size: int) -> None:
    """``ValueError`` unless ``shard``'s file, of ``size`` bytes, holds the tokens the manifest gives it (a copy cut
    short, another dataset's shard): at admission, and again by each worker that opens it."""
    expected = shard.tokens * DTYPES[manifest.dtype]
    if size != expected:
        raise ValueError(f"dataset {directory!r}: shard {shard.file} has {size} bytes, the manifest says {expected}; "
                         "prepare the dataset again")


def _wrong_field(m: Manifest) -> str:
    """What of a manifest's values the service and the workers could not use as they are (``""``: nothing):
    :func:`from_plain` takes the JSON's values as they come, so a string ``vocab_size`` was a 500 at submit."""
    def count(v: object, least: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= least

    if not count(m.vocab_size, 1):
        return f"vocab_size {m.vocab_size!r}, not a positive integer"
    if m.dtype not in DTYPES:
        return f"dtype {m.dtype!r}, not one of {', '.join(DTYPES)}"
    for name in ("key", "tokenizer_sha256"):
        if not isinstance(getattr(m, name), str):
            return f"{name} {getattr(m, name)!r}, not a string"
    for split in ("train", "val"):
        s = m.split(split)
        for sh in s.shards:
            if not count(sh.tokens):
                return f"{split} shard {sh.file} of {sh.tokens!r} tokens, not a count"
            if not isinstance(sh.sha256, str):
                return f"{split} shard {sh.file} with sha256 {sh.sha256!r}, not a string"
        if not count(s.tokens) or not count(s.documents):
            return f"{split}.tokens {s.tokens!r} and {split}.documents {s.documents!r}, not both counts"
        if s.tokens != sum(sh.tokens for sh in s.shards):
            return f"{split}.tokens {s.tokens}, but its shards hold {sum(sh.tokens for sh in s.shards)}"
    return ""


def tokenizer_sha256(tokenizer_json: str) -> str:
    """A manifest's ``tokenizer_sha256`` of a ``tokenizer.json``'s text: the hash of the tokenizer as the
    ``tokenizers`` library saves it. ``data prepare --tokenizer PATH`` saves the tokenizer it loaded, whose bytes
    can differ from PATH's (formatting, key order) with the same ids, so a file is compared in that form."""
    from tokenizers import Tokenizer

    return hashlib.sha256(Tokenizer.from_str(tokenizer_json).to_str(pretty=True).encode("utf-8")).hexdigest()


def check_pinned(directory: str, manifest: Manifest, pin: DataPin | None) -> None:
    """A ``ValueError`` saying what changed when the dataset is not the one the service admitted the job on
    (``pin``; ``None``: not pinned, a job admitted before pins existed or one run without the service)."""
    if pin is None or not pin.manifest_key or pin.manifest_key == manifest.key:
        return
    tokenizer = (" with another tokenizer" if pin.tokenizer_sha256 != manifest.tokenizer_sha256 else
                 " (same tokenizer, other inputs or options)")
    raise ValueError(
        f"dataset {directory!r} was prepared again{tokenizer} after this job was submitted (manifest key "
        f"{pin.manifest_key[:12]}... then, {manifest.key[:12]}... now): training on it would change which samples "
        "every step reads (repeating and skipping some) mid-job. Put the dataset back as it was (`meridian data "
        "prepare` with the same inputs and options), or submit a new job; prepare new data into a new directory")


def is_plain_name(name: object) -> bool:
    """A file name that stays inside its directory whatever the directory is: no separator, not ``.``/``..``."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def open_dataset_file(directory: str, name: str) -> int:
    """A read-only descriptor of the regular file ``name`` of a dataset directory. A symlink (even one that stays
    inside the data roots: the service checked none) and anything but a regular file are a ``ValueError``
    naming the file, as is a name with a path in it; non-blocking, so a named pipe cannot hang the caller."""
    if not is_plain_name(name):
        raise ValueError(f"dataset {directory!r}: {name!r} is not a plain file name; prepare the dataset again")
    try:
        return open_regular(os.path.join(directory, name))
    except OSError as e:
        raise ValueError(f"dataset {directory!r}: {name} cannot be opened ({e.strerror}); it must be a regular "
                         "file, not a symlink; prepare the dataset again") from None
    except NotRegularFile:
        raise ValueError(f"dataset {directory!r}: {name} is not a regular file; prepare the dataset again") from None


def check_dataset_files(directory: str, manifest: Manifest) -> None:
    """Before a job is admitted: every shard the manifest names is a regular file of the directory (not a
    symlink) of the size its token count makes, and its other files, where present, regular files too.
    ``ValueError`` naming the first one that is not."""
    shards = {sh.file: sh for s in (manifest.train, manifest.val) for sh in s.shards}
    for what, name in manifest.files():
        try:
            st = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            if what.endswith("shard"):
                raise ValueError(f"dataset {directory!r}: {what} {name} is missing; prepare the dataset again") from None
            continue  # the tokenizer and document index: not read by training
        if not stat.S_ISREG(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise ValueError(f"dataset {directory!r}: {what} {name} is {kind}; a dataset's files must be regular "
                             "files inside its directory (copy the data there instead of linking it)")
        if what.endswith("shard"):
            check_shard_size(directory, manifest, shards[name], st.st_size)


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Atomically: a reader sees the old manifest or the new one, never half of one."""
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest.to_dict(), f, indent=2)
    os.replace(tmp, os.path.join(directory, MANIFEST))
