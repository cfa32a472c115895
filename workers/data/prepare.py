"""``meridian data prepare``: text and JSON-lines files → memory-mapped token shards; torch-free.

Documents stream from the inputs in batches and are encoded with Hugging Face ``tokenizers``'
``encode_batch``, which runs on every core (its Rust thread pool), so neither the corpus nor its tokens are
ever held whole in memory. A text file's document is a paragraph, cut at the first line end after
:data:`MAX_DOCUMENT_BYTES`: a file with no blank lines (a sentence or a document per line) would otherwise be
one document, held and encoded whole (60 MB of text peaked at 7.4 GiB) and never split for validation. The
result is described in :mod:`meridian.workers.data.manifest`. The key of a run hashes the inputs' contents
and every option: a rerun with the same key returns the existing manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from meridian.workers.data.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    InputFile,
    Manifest,
    Shard,
    Split,
    read_manifest,
    tokenizer_sha256,
    write_manifest,
)

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB of uint16 per shard file
BATCH_DOCS = 512
BATCH_BYTES = 1 << 24
"""A batch is encoded once it holds this much text, even with fewer than :data:`BATCH_DOCS` documents."""
MAX_DOCUMENT_BYTES = 1 << 16
"""A text file's paragraph longer than this ends a document at the next line end (64 KiB: a batch of
:data:`BATCH_DOCS` such documents is 32 MiB of text and its tokens a few hundred MB as Python ints)."""
_PARAGRAPHS = re.compile(r"\n[ \t]*\n")


class PrepareError(ValueError):
    """Bad input or options, with a message naming the file at fault."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class PrepareOptions:
    tokenizer: str = ""
    """Path of a ``tokenizer.json`` to use as it is (exclusive with ``train_tokenizer``)."""
    train_tokenizer: bool = False
    vocab_size: int = 0
    """Size of the byte-level BPE trained on the inputs (with ``train_tokenizer``)."""
    val_fraction: float = 0.05
    text_field: str = "text"
    max_vocab: int = 0
    """Fail when the tokenizer's ids need more embedding rows than this (a model's ``vocab_size``): its largest
    id + 1; 0: no limit."""
    shard_tokens: int = SHARD_TOKENS

    def check(self) -> None:
        if bool(self.tokenizer) == bool(self.train_tokenizer):
            raise PrepareError("give exactly one of --tokenizer PATH or --train-tokenizer --vocab-size N")
        if self.train_tokenizer and not 257 <= self.vocab_size <= 1 << 20:
            raise PrepareError(f"--vocab-size must be in [257, {1 << 20}] for a byte-level BPE (256 byte tokens "
                               f"and <|endoftext|>), got {self.vocab_size}")
        if not 0 <= self.val_fraction < 1:
            raise PrepareError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if not self.text_field:
            raise PrepareError("--text-field must not be empty")


@dataclass
class PrepareResult:
    manifest: Manifest
    directory: str
    reused: bool
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.manifest.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        m = self.manifest
        return {"directory": self.directory, "reused": self.reused, "seconds": round(self.seconds, 3),
                "tokens": m.tokens, "train_tokens": m.train.tokens, "val_tokens": m.val.tokens,
                "documents": m.train.documents + m.val.documents, "vocab_size": m.vocab_size, "dtype": m.dtype,
                "tokenizer_sha256": m.tokenizer_sha256, "tokens_per_s": round(self.tokens_per_s, 1)}


# -- inputs ----------------------------------------------------------------------------------------------
# The first bytes of gzip, xz and zstd files (a packaged doc folder is mostly gzip); none can start UTF-8 text.
COMPRESSED_MAGIC = (b"\x1f\x8b", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")


def _compressed_kind(head: bytes) -> str:
    names = ("gzip", "xz", "zstd")
    return next(n for n, magic in zip(names, COMPRESSED_MAGIC, strict=True) if head.startswith(magic))


def _is_jsonl(path: str) -> bool:
    return path.lower().endswith(JSONL_SUFFIXES)


def _hash_and_check(path: str) -> InputFile:
    """Content hash of one input; a directory, a missing, empty, compressed or binary file is a
    :class:`PrepareError` naming it and saying what to give instead."""
    if os.path.isdir(path):
        raise PrepareError(f"{path}: a directory; name its files instead ({path.rstrip(os.sep)}{os.sep}*)", path)
    h = hashlib.sha256()
    size, blank = 0, True
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                if size == 0 and chunk.startswith(COMPRESSED_MAGIC):
                    raise PrepareError(f"{path}: a compressed file ({_compressed_kind(chunk)}); decompress it "
                                       "first and give the text", path)
                if size == 0 and b"\x00" in chunk[:8192]:
                    raise PrepareError(f"{path}: binary file (NUL bytes); give UTF-8 text or JSON lines", path)
                blank = blank and not chunk.strip()
                h.update(chunk)
                size += len(chunk)
    except OSError as e:
        raise PrepareError(f"{path}: cannot be read: {e.strerror}", path) from None
    if size == 0 or blank:
        raise PrepareError(f"{path}: empty file (no text to tokenise)", path)
    return InputFile(path=os.path.abspath(path), sha256=h.hexdigest(), bytes=size)


def _lines(path: str) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PrepareError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start}); binary file?",
                                   path) from None


def iter_documents(path: str, text_field: str) -> Iterator[tuple[str, int]]:
    """``(document, bytes read so far)``: a JSON-lines file's ``text_field`` per line; a text file's
    paragraphs (runs of lines separated by a blank line), each cut at the first line end after
    :data:`MAX_DOCUMENT_BYTES` bytes (a single longer line stays whole)."""
    done = 0
    if _is_jsonl(path):
        for lineno, line in _lines(path):
            done += len(line.encode("utf-8"))
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepareError(f"{path}:{lineno}: not a JSON line ({e.msg})", path) from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise PrepareError(f"{path}:{lineno}: no {text_field!r} field (use --text-field to name it)", path)
            if not isinstance(obj[text_field], str):
                raise PrepareError(f"{path}:{lineno}: field {text_field!r} is not a string", path)
            if obj[text_field]:
                yield obj[text_field], done
        return
    para: list[str] = []
    para_bytes = 0
    for _, line in _lines(path):
        size = len(line.encode("utf-8"))
        done += size
        if line.strip():
            para.append(line)
            para_bytes += size
        if para and (not line.strip() or para_bytes >= MAX_DOCUMENT_BYTES):
            yield "".join(para), done
            para, para_bytes = [], 0
    if para:
        yield "".join(para), done


# -- tokenizer -------------------------------------------------------------------------------------------
def train_bpe(paths: list[str], vocab_size: int, text_field: str):
    """A byte-level BPE (GPT-2 style) trained on the inputs, with ``<|endoftext|>`` as its last special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((doc for p in paths for doc, _ in iter_documents(p, text_field)), trainer)
    return tok


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise PrepareError(f"{path}: not a Hugging Face tokenizer.json ({e})", path) from None


def id_space(tok) -> int:
    """Embedding rows the tokenizer's ids need: its largest id + 1. Not its token count
    (``get_vocab_size``): a tokenizer.json may leave ids unused, and a model sized by the count would meet
    ids past its last row."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(ids) + 1 if ids else 0


def _eos_id(tok) -> int | None:
    for t in EOS_CANDIDATES:
        i = tok.token_to_id(t)
        if i is not None:
            return i
    return None


# -- writing ---------------------------------------------------------------------------------------------
class _SplitWriter:
    """One split's token stream, cut into shard files; documents' start offsets kept for the index."""

    def __init__(self, directory: str, name: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.name, self.dtype, self.shard_tokens = directory, name, dtype, shard_tokens
        self.shards: list[Shard] = []
        self.starts: list[int] = []
        self.tokens = 0
        self._file = None
        self._hash = hashlib.sha256()
        self._in_shard = 0

    def _open(self) -> None:
        fname = f"{self.name}-{len(self.shards):05d}.bin"
        self._file = open(os.path.join(self.directory, fname + ".tmp"), "wb")  # noqa: SIM115 - closed in _close
        self._hash = hashlib.sha256()
        self.shards.append(Shard(file=fname, tokens=0))
        self._in_shard = 0

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            fname = self.shards[-1].file
            os.replace(os.path.join(self.directory, fname + ".tmp"), os.path.join(self.directory, fname))
            # The bytes as written: a node that copies the dataset from a URL checks its copy against them.
            self.shards[-1] = Shard(file=fname, tokens=self._in_shard, sha256=self._hash.hexdigest())
            self._file = None

    def add(self, ids: np.ndarray) -> None:
        self.starts.append(self.tokens)
        self.tokens += len(ids)
        while len(ids):
            if self._file is None or self._in_shard >= self.shard_tokens:
                self._close()
                self._open()
            take = min(len(ids), self.shard_tokens - self._in_shard)
            chunk = np.ascontiguousarray(ids[:take])
            self._hash.update(chunk.data)
            chunk.tofile(self._file)
            self._in_shard += take
            ids = ids[take:]

    def finish(self) -> Split:
        self._close()
        index = f"{self.name}-docs.npy"
        np.save(os.path.join(self.directory, index), np.asarray(self.starts, dtype=np.int64))
        return Split(tokens=self.tokens, documents=len(self.starts), shards=tuple(self.shards), doc_index=index)


class _Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.t0, self._last = max(1, total), enabled, time.monotonic(), 0.0

    def update(self, done: int, tokens: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self._last < 0.1):
            return
        self._last = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(30 * frac)
        rate = tokens / max(1e-9, now - self.t0)
        sys.stderr.write(f"\rtokenising [{bar:<30}] {100 * frac:5.1f}%  {tokens:,} tokens  {rate:,.0f} tok/s")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _key(inputs: list[InputFile], opts: PrepareOptions, tokenizer_sha: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, "inputs": [i.sha256 for i in inputs], "tokenizer": tokenizer_sha,
                         "train": opts.train_tokenizer, "vocab": opts.vocab_size, "val": opts.val_fraction,
                         "field": opts.text_field, "shard": opts.shard_tokens}, sort_keys=True).encode())
    return h.hexdigest()


def _file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


LOCK_FILE = ".prepare.lock"


@contextlib.contextmanager
def _writing(out: str) -> Iterator[None]:
    """Hold ``out``'s lock while a run deletes and writes its files: a second run into the same directory at the
    same time would delete the first's half-written shards and write its own under the first's manifest. That
    second run is refused at once (a wait could last as long as the first run), saying what to do."""
    fd = os.open(os.path.join(out, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrepareError(f"{out}: another `meridian data prepare` is writing this directory now; wait for it "
                               "to end and run this again (the same inputs and options reuse what it wrote), or "
                               "prepare into another directory", out) from None
        yield
    finally:
        os.close(fd)  # releases the lock


def prepare(inputs: list[str], out: str, opts: PrepareOptions, *, progress: bool = True,
            log: Callable[[str], None] | None = None) -> PrepareResult:
    """Tokenise ``inputs`` into the dataset directory ``out`` (reusing it when its key matches)."""
    t0 = time.monotonic()
    opts.check()
    if not inputs:
        raise PrepareError("no input files given")
    files = [_hash_and_check(p) for p in inputs]
    if opts.tokenizer and not os.path.isfile(opts.tokenizer):
        raise PrepareError(f"{opts.tokenizer}: no such tokenizer file", opts.tokenizer)
    given_sha = _file_sha(opts.tokenizer) if opts.tokenizer else ""
    key = _key(files, opts, given_sha)
    if os.path.exists(os.path.join(out, MANIFEST)):
        try:
            old = read_manifest(out)
        except ValueError:
            old = None
        if old is not None and old.key == key:  # (--max-vocab is not in the key: it changes no byte written)
            if opts.max_vocab and old.vocab_size > opts.max_vocab:
                raise PrepareError(f"{out}: the dataset there (same inputs and options) has a vocabulary of "
                                   f"{old.vocab_size} tokens, too large for the model's vocab_size {opts.max_vocab}",
                                   os.path.join(out, MANIFEST))
            return PrepareResult(old, os.path.abspath(out), True, time.monotonic() - t0)
    if opts.tokenizer:
        tok = load_tokenizer(opts.tokenizer)
    else:
        if log:
            log(f"training a byte-level BPE of {opts.vocab_size} tokens on {len(files)} file(s)")
        tok = train_bpe([f.path for f in files], opts.vocab_size, opts.text_field)
    vocab = id_space(tok)
    where = opts.tokenizer or "the trained tokenizer"
    count = tok.get_vocab_size(with_added_tokens=True)
    holes = f" (its {count} tokens have ids up to {vocab - 1})" if count != vocab else ""
    if opts.max_vocab and vocab > opts.max_vocab:
        raise PrepareError(f"{where}: vocabulary of {vocab} tokens{holes} is too large for the model's vocab_size "
                           f"{opts.max_vocab}", opts.tokenizer)
    if vocab > 1 << 32:
        raise PrepareError(f"{where}: vocabulary of {vocab} tokens{holes} does not fit uint32", opts.tokenizer)

    os.makedirs(out, exist_ok=True)  # only now: a refused tokenizer leaves an earlier dataset here as it was
    with _writing(out):  # one run writes a directory at a time
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, MANIFEST))  # from here on the directory is unfinished
        for name in os.listdir(out):  # shards of an earlier run with other inputs
            if name.startswith(("train-", "val-")) and name.endswith((".bin", ".bin.tmp", ".npy")):
                os.remove(os.path.join(out, name))
        tok_path = os.path.join(out, "tokenizer.json")
        tok.save(tok_path)
        dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
        eos = _eos_id(tok)

        writers = {s: _SplitWriter(out, s, dtype, opts.shard_tokens) for s in ("train", "val")}
        bar = _Progress(sum(f.bytes for f in files), progress)
        doc_no, base, tokens = 0, 0, 0
        counted: list[InputFile] = []
        for f in files:
            docs_here = 0
            batch: list[str] = []
            batch_bytes = 0
            for doc, done in iter_documents(f.path, opts.text_field):
                batch.append(doc)
                batch_bytes += len(doc)
                if len(batch) >= BATCH_DOCS or batch_bytes >= BATCH_BYTES:
                    doc_no, tokens = _encode(tok, batch, writers, doc_no, eos, opts.val_fraction, tokens)
                    docs_here += len(batch)
                    batch, batch_bytes = [], 0
                    bar.update(base + done, tokens)
            if batch:
                doc_no, tokens = _encode(tok, batch, writers, doc_no, eos, opts.val_fraction, tokens)
                docs_here += len(batch)
            if docs_here == 0:
                raise PrepareError(f"{f.path}: no documents (every line is empty)", f.path)
            base += f.bytes
            bar.update(base, tokens)
            counted.append(replace(f, documents=docs_here))
        bar.update(base, tokens, final=True)
        train, val = writers["train"].finish(), writers["val"].finish()
        manifest = Manifest(key=key, vocab_size=vocab, dtype=dtype.name, tokenizer_sha256=tokenizer_sha256(tok.to_str()),
                            tokenizer_trained=opts.train_tokenizer, eos_id=eos, text_field=opts.text_field,
                            val_fraction=opts.val_fraction, train=train, val=val, inputs=tuple(counted))
        write_manifest(out, manifest)
    return PrepareResult(manifest, os.path.abspath(out), False, time.monotonic() - t0)


def is_val_document(doc_no: int, val_fraction: float) -> bool:
    """Evenly spaced: document ``i`` is held out when ``floor((i + 1) f) > floor(i f)``."""
    return int((doc_no + 1) * val_fraction) > int(doc_no * val_fraction)


def _encode(tok, batch: list[str], writers: dict[str, _SplitWriter], doc_no: int, eos: int | None,
            val_fraction: float, tokens: int) -> tuple[int, int]:
    dtype = writers["train"].dtype
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no character offsets: 2-3x faster
    for enc in encode(batch, add_special_tokens=False):  # parallel over every core
        ids = enc.ids + [eos] if eos is not None else enc.ids
        arr = np.asarray(ids, dtype=dtype)
        writers["val" if is_val_document(doc_no, val_fraction) else "train"].add(arr)
        doc_no += 1
        tokens += len(arr)
    return doc_no, tokens

