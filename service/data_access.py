"""Which training text (and which ``model.init_from`` checkpoint) a job may read: a server-side allow-list of data roots, checked at submit (and, through :mod:`meridian.service.tracking`, where its trackers may write).

A job's ``data.source`` is opened by its workers with the service's own rights, so the service decides what
it may name: the built-in corpus, or a regular file under one of :attr:`DataAccess.roots` (``meridian serve
--data-root PATH``, repeatable; by default ``<data dir>/data``), after resolving symlinks and ``..`` with
``realpath``, and at most :attr:`DataAccess.max_bytes` of it. A refused path gets the same answer whether or
not it exists outside the roots, so the check reveals nothing about other files. The job keeps the resolved
path, and the workers open it refusing anything but a regular file
(:func:`meridian.workers.data.text.load_text`). A prepared dataset is admitted by its directory, and every file
its manifest names must be a plain name of a regular file inside it (no ``..``, no absolute name, no symlink),
which the workers check again as they open them (:func:`meridian.workers.data.manifest.open_dataset_file`).

A fine-tuning job (``model.init_from``) must train on token ids that mean to the checkpoint what they meant
when it was trained (:func:`check_init_from_data`).

Admission also pins what it found (``data.pins``): each dataset's manifest key and tokenizer hash, a text
source's hash. The workers refuse data that has changed since, and the pins are part of the checkpoint
fingerprint, so neither a recovering worker nor a resume trains on data the job was not admitted on.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meridian.service.errors import InvalidJob
from meridian.service.jobs import JobRequest
from meridian.service.locations import NotUnderRoots, UrlRoot, admit_url
from meridian.service.tracking import TrackingAccess, admit_tracking
from meridian.workers.contracts.config import DataConfig, DataPin
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.contracts.regular_files import NotRegularFile, open_regular
from meridian.workers.data.manifest import check_dataset_files, is_url, read_manifest, tokenizer_sha256
from meridian.workers.data.remote import check_remote_files, manifest_of
from meridian.workers.data.source import read_source, source_sha256, split_bytes

BUILTIN_SOURCES = ("builtin:python-reference",)
DEFAULT_MAX_BYTES = 128 * 2**20
"""Bytes of text one job may read: each worker holds them as int64 tokens (8x), so 128 MiB is 1 GiB each."""


@dataclass(frozen=True)
class DataAccess:
    roots: tuple[str, ...] = ()
    """Folders whose regular files jobs may train on (resolved with ``realpath`` when checked); a ``file://`` URL
    is admitted under them too."""
    max_bytes: int = DEFAULT_MAX_BYTES
    url_roots: tuple[UrlRoot, ...] = ()
    """URL prefixes (``s3://bucket/prefix``) under which jobs may name prepared datasets
    (:mod:`meridian.service.locations`)."""
    tracking: TrackingAccess = TrackingAccess()
    """Where a job's trackers may write (:mod:`meridian.service.tracking`)."""
    storage_root: str = ""
    """The jobs' storage (``ServiceConfig.checkpoint_root``): where trackers write by default."""

    @classmethod
    def for_roots(cls, roots: Sequence[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                  tracking_roots: Sequence[str] = (), storage_root: str = "") -> DataAccess:
        """``roots`` as ``meridian serve --data-root`` gives them: folders, and URLs (``file://`` ones are folders);
        ``tracking_roots`` as ``--tracking-root`` gives them."""
        local = [r.removeprefix("file://") if r.startswith("file://") else r for r in roots
                 if not is_url(r) or r.startswith("file://")]
        urls = tuple(UrlRoot.parse(r) for r in roots if is_url(r) and not r.startswith("file://"))
        return cls(tuple(os.path.realpath(os.path.expanduser(r)) for r in local), max_bytes, urls,
                   TrackingAccess.for_roots(tracking_roots), storage_root)

    def admit_url(self, url: str, field: str) -> str:
        """``url`` if it is under one of :attr:`url_roots` (nothing is fetched to decide); :class:`InvalidJob`
        (a 422) naming ``field``, in the same words whether or not anything is there. The rule every URL a job
        names for reading is held to."""
        try:
            return admit_url(url, self.url_roots, field=field, flag="--data-root")
        except NotUnderRoots as e:
            raise InvalidJob(str(e)) from None

    def admit(self, request: JobRequest) -> JobRequest:
        """``request`` with its data source and its trackers checked and resolved; raises :class:`InvalidJob` (a
        422)."""
        request = replace(request, tracking=admit_tracking(request.tracking, self.tracking, self.storage_root))
        data = self.check(request.data)
        if request.model.init_from:
            request = replace(request, model=replace(request.model,
                                                     init_from=self.admit_checkpoint(request.model.init_from)))
        if request.model.init_from:
            check_init_from_data(data, request.model.init_from)
        check_dataset_vocab(data, request.model)
        check_train_split(data, request.model)
        if request.validation is not None:
            check_validation_split(data, request.model)
        return replace(request, data=data)

    def admit_checkpoint(self, directory: str) -> str:
        """``model.init_from``: the real path of a directory under the data roots, checked before anything in it
        is read; :class:`InvalidJob` (a 422) naming the path and the roots otherwise, in the same words whether
        or not it exists."""
        return self.admit_directory(directory, "model.init_from", "the Hugging Face checkpoint")

    def admit_directory(self, directory: str, field: str, what: str) -> str:
        """The real path of ``directory`` if it is a directory under the data roots (``file://`` or not); else
        :class:`InvalidJob` naming ``field`` and the fix (copy ``what`` there), whether or not it exists."""
        path = _realpath(directory.removeprefix("file://"))
        if not path or not any(_under(path, root) for root in self.roots) or not os.path.isdir(path):
            raise InvalidJob(
                f"{field} {directory!r} is not a directory under this service's data roots "
                f"({', '.join(self.roots) or 'none configured'}); copy {what} there, or start "
                "the service with `meridian serve --data-root PATH`")
        return path

    def check(self, data: DataConfig) -> DataConfig:
        if data.datasets:
            return self._check_datasets(data)
        if data.max_bytes > self.max_bytes:
            raise InvalidJob(f"data.max_bytes {data.max_bytes} is over this service's limit of {self.max_bytes} "
                             "bytes per job; ask for less")
        if data.source in BUILTIN_SOURCES:
            return replace(data, pins=())
        refused = InvalidJob(
            f"data.source {data.source!r} is not a readable regular file under this service's data roots "
            f"({', '.join(self.roots) or 'none configured'}); copy the text there, or start the service with "
            f"`meridian serve --data-root PATH`. Built-in: {', '.join(BUILTIN_SOURCES)}")
        path = _realpath(data.source)
        if not path or not any(_under(path, root) for root in self.roots):
            raise refused  # the same words whether or not it exists: nothing is learned about other files
        try:
            st = os.stat(path)
        except OSError:
            raise refused from None
        if not stat.S_ISREG(st.st_mode):
            raise refused
        try:  # the bytes the job will read, pinned: its workers refuse the file once they differ
            text = read_source(path, data.max_bytes, where="by the service")
        except ValueError:
            raise refused from None
        return replace(data, source=path, pins=(DataPin(path=path, sha256=source_sha256(text)),))


    def _check_datasets(self, data: DataConfig) -> DataConfig:
        """Prepared datasets: directories under the roots holding a manifest, read only once admitted, each
        pinned to its manifest's key and tokenizer hash (the workers refuse a dataset prepared again since)."""
        pins: list[DataPin] = []

        def resolve(directory: str) -> str:
            if is_url(directory):
                return resolve_url(directory)
            path = _realpath(directory)
            if not path or not any(_under(path, root) for root in self.roots) or not os.path.isdir(path):
                raise InvalidJob(
                    f"data: {directory!r} is not a prepared dataset directory under this service's data roots "
                    f"({', '.join(self.roots) or 'none configured'}); write it there with `meridian data prepare "
                    "... --out DIR`, or start the service with `meridian serve --data-root PATH`")
            try:
                # The roots hold the directory; the files its manifest names must stay in it (plain names,
                # regular files, no symlinks), or a manifest could point the workers anywhere.
                manifest = read_manifest(path)
                check_dataset_files(path, manifest)
            except ValueError as e:
                raise InvalidJob(f"data: {e}") from None
            pins.append(DataPin(path=path, manifest_key=manifest.key, tokenizer_sha256=manifest.tokenizer_sha256))
            return path

        def resolve_url(url: str) -> str:
            """A dataset by URL: a ``file://`` one under the data roots as a path is (its real path), any other
            under :attr:`url_roots`; its manifest and shards read through fsspec only once it is admitted."""
            if url.startswith("file://"):
                path = _realpath(url.removeprefix("file://"))
                if not path or not any(_under(path, root) for root in self.roots) or not os.path.isdir(path):
                    raise InvalidJob(
                        f"data: {url!r} is not a prepared dataset directory under this service's data roots "
                        f"({', '.join(self.roots) or 'none configured'}); write it there with `meridian data "
                        "prepare ... --out DIR`, or start the service with `meridian serve --data-root PATH`")
                url = f"file://{path}"
            else:
                url = self.admit_url(url, "data")
            try:
                manifest = manifest_of(url)
                check_remote_files(url, manifest)
            except ValueError as e:
                raise InvalidJob(f"data: {e}") from None
            pins.append(DataPin(path=url, manifest_key=manifest.key, tokenizer_sha256=manifest.tokenizer_sha256))
            return url

        if data.dataset:
            data = replace(data, dataset=resolve(data.dataset))
        else:
            named: dict[str, str] = {}  # real path → the name it was first given by (two names, one directory)
            blend = []
            for b in data.blend:
                path = resolve(b.dataset)
                if path in named:
                    raise InvalidJob(f"data.blend names dataset {path!r} twice ({named[path]!r} and {b.dataset!r}); "
                                     "name each dataset once, with the weight of all the samples it should give")
                named[path] = b.dataset
                blend.append(replace(b, dataset=path))
            data = replace(data, blend=tuple(blend))
        return replace(data, pins=tuple(pins))


def check_init_from_data(data: DataConfig, checkpoint: str) -> None:
    """A fine-tuning job's token ids must mean to the checkpoint what they meant when it was trained: a prepared
    dataset (never raw text, read as bytes), made with one tokenizer, and with the checkpoint's own when its
    directory holds a ``tokenizer.json``. Uses the tokenizer hashes admission pinned (``data.pins``)."""
    prepare_hint = (f"`meridian data prepare FILES --out NEW_DIR --tokenizer {os.path.join(checkpoint, 'tokenizer.json')}`"
                    if os.path.lexists(os.path.join(checkpoint, "tokenizer.json")) else
                    "`meridian data prepare FILES --out NEW_DIR --tokenizer <the checkpoint's tokenizer.json>`")
    if not data.datasets:
        raise InvalidJob(
            f"data.source {data.source!r} is read as raw bytes (token id = byte value), which mean other tokens to "
            f"model.init_from's vocabulary; prepare the text with the checkpoint's tokenizer, {prepare_hint}, and "
            "name NEW_DIR in data.dataset")
    hashes = {p.path: p.tokenizer_sha256 for p in data.pins}
    if len(set(hashes.values())) > 1:
        raise InvalidJob("data.blend mixes datasets made with different tokenizers ("
                         + ", ".join(f"{d}: {h[:12]}" for d, h in hashes.items())
                         + f"), whose ids mean different tokens to model.init_from; prepare each with {prepare_hint}")
    path = os.path.join(checkpoint, "tokenizer.json")
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return  # no tokenizer to compare with: the vocabulary size is all admission can check
    except OSError as e:
        raise InvalidJob(f"model.init_from: {path} cannot be read ({e.strerror}); it must be a regular file, not a "
                         "symlink") from None
    except NotRegularFile:
        raise InvalidJob(f"model.init_from: {path} is not a regular file") from None
    with os.fdopen(fd, "rb") as f:
        text = f.read()
    try:
        want = tokenizer_sha256(text.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise InvalidJob(f"model.init_from: {path} is not a Hugging Face tokenizer.json ({e})") from None
    for directory, have in hashes.items():
        if have != want:
            raise InvalidJob(
                f"data: dataset {directory!r} was made with another tokenizer than model.init_from's ({path}): its "
                f"token ids would mean other tokens to the checkpoint. Prepare the text again with {prepare_hint} "
                "and name NEW_DIR in data.dataset")


def check_dataset_vocab(data: DataConfig, model: ModelConfig) -> None:
    """A job's model must have a row for every token of its prepared dataset(s) (read from the manifests), or of
    raw text: its bytes are its token ids, 0-255."""
    if not data.datasets and model.vocab_size < 256:
        raise InvalidJob(f"data.source {data.source!r} is read as bytes (token ids 0-255) but model.vocab_size is "
                         f"{model.vocab_size}; set model.vocab_size >= 256, or prepare the text with a tokenizer "
                         "of that size (`meridian data prepare`) and name it in data.dataset")
    best, where = 0, ""
    for directory, _ in data.datasets:
        vocab = manifest_of(directory).vocab_size
        if vocab > best:
            best, where = vocab, directory
    if best > model.vocab_size:
        raise InvalidJob(f"data: dataset {where!r} has a vocabulary of {best} tokens but model.vocab_size is "
                         f"{model.vocab_size}; set model.vocab_size >= {best}")


def _text_bytes(data: DataConfig) -> int | None:
    """How many bytes of its admitted text file a job reads (``None``: the built-in corpus, ~465 KB)."""
    if data.datasets or data.source in BUILTIN_SOURCES:
        return None
    try:
        return min(os.stat(data.source).st_size, data.max_bytes)
    except OSError as e:  # removed since it was admitted, a moment ago
        raise InvalidJob(f"data.source {data.source!r} cannot be read by the service ({e.strerror})") from None


def _text_split_too_short(data: DataConfig, model: ModelConfig, split: str) -> tuple[int, int] | None:
    """(the text's bytes, the split's) when a job's text holds less than one sample in ``split``; else ``None``
    (enough, or no text file: the built-in corpus, or prepared datasets)."""
    size = _text_bytes(data)
    if size is None:
        return None
    start, stop = split_bytes(size, split)
    return (size, stop - start) if stop - start < model.seq_len + 1 else None


def check_train_split(data: DataConfig, model: ModelConfig) -> None:
    """Every job needs one training sample (``seq_len + 1`` tokens) in each of its datasets, or in its text's
    first 95 %, which its workers would otherwise fail on after placement."""
    if short := _text_split_too_short(data, model, "train"):
        size, held = short
        raise InvalidJob(f"data.source {data.source!r} has {size} bytes; its first 95 % ({held} bytes, one token "
                         f"each) is fewer than one sample of model.seq_len + 1 = {model.seq_len + 1}; use a longer "
                         "text or a shorter model.seq_len")
    for directory, _ in data.datasets:
        train = manifest_of(directory).train
        if train.tokens < model.seq_len + 1:
            raise InvalidJob(f"data: dataset {directory!r} has {train.tokens} train tokens, fewer than one sample of "
                             f"model.seq_len + 1 = {model.seq_len + 1}; prepare more text into it or shorten "
                             "model.seq_len")


def check_validation_split(data: DataConfig, model: ModelConfig) -> None:
    """A job with ``validation`` needs one sample (``seq_len + 1`` tokens) in each dataset's validation split,
    or in its text's held-out last 5 %, which its workers would otherwise fail on after placement."""
    if short := _text_split_too_short(data, model, "val"):
        size, held = short
        raise InvalidJob(f"validation: data.source {data.source!r} has {size} bytes; its held-out last 5 % ({held} "
                         f"bytes) is fewer than one sample of model.seq_len + 1 = {model.seq_len + 1}; use a text of "
                         f"at least {20 * (model.seq_len + 1) + 20} bytes, a shorter model.seq_len, or drop validation")
    for directory, _ in data.datasets:
        val = manifest_of(directory).val
        if val.tokens < model.seq_len + 1:
            raise InvalidJob(
                f"validation: dataset {directory!r} has {val.tokens} validation tokens ({val.documents} documents), "
                f"fewer than one sample of model.seq_len + 1 = {model.seq_len + 1}; prepare it again with a larger "
                "--val-fraction or more documents (a text file's documents are its paragraphs, separated by blank "
                "lines and cut after 64 KiB; a JSON-lines file's are its lines), or drop validation")


def _realpath(path: str) -> str:
    """``realpath`` of an absolute path; ``""`` for a relative one or one no file can have (a NUL byte, on
    which ``realpath`` raises): refused like any other path outside the roots."""
    return os.path.realpath(path) if os.path.isabs(path) and "\0" not in path else ""


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root and path != root
