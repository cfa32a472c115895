"""Where durable checkpoints live, a local folder or an fsspec URL (``s3://bucket/prefix``, ``gs://…``), and
how a checkpoint is committed on either.

Torch-free: the service lists a job's artifacts and proves its storage writable with it.

A job's folder holds one folder per checkpoint, ``step-<N>/``, each with a *marker* file written after every
other file of it (``meridian.json`` for the sharded format, ``state.pt``, the whole state, for the single-file
one), and ``latest``, the name of the newest committed checkpoint. Readers start from ``latest``; the listing
shows only folders with their marker. How a save commits:

- **local folder**: the files go to a hidden ``.step-<N>.partial`` folder, which is renamed into place (a
  rename: the folder appears whole or not at all), then ``latest`` is replaced atomically. Each step reaches
  the disk before the next names it (``fsync`` of every file written, of the folder, of the rename, of
  ``latest``), so a power loss leaves the previous checkpoint or the new one, never a name without its bytes.
- **URL** (an object store has no directories and no atomic rename): the files go straight to ``step-<N>/``,
  the marker last, and ``latest`` (one small object, one PUT, written after the marker) is the commit point.
  A save of the step ``latest`` names first points ``latest`` back at the previous complete checkpoint and
  deletes the marker, so no reader ever trusts a folder being rewritten. A crashed save leaves a folder
  without a marker: never listed, never read, deleted by the next commit.

Credentials and endpoints come from the environment, read the way the filesystem's library reads them (for
S3, s3fs/botocore: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` …).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

LATEST = "latest"
MARKERS = ("meridian.json", "state.pt")
"""A checkpoint folder is complete once one of these exists in it (each format writes its own last)."""
PREFIX = "step-"


def is_url(location: str) -> bool:
    return "://" in location


def join(root: str, *names: str) -> str:
    if is_url(root):
        return "/".join([root.rstrip("/"), *names])
    return os.path.join(root, *names)


def check_url(url: str) -> str:
    """``url`` without a trailing ``/`` if fsspec knows its scheme, the scheme's package is importable and it
    names a location, else a ``ValueError`` saying what to fix."""
    import fsspec

    protocol, _, rest = url.partition("://")
    if not rest.strip("/"):
        raise ValueError(f"storage {url!r} names no bucket or folder; give e.g. {protocol}://bucket/checkpoints")
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError as e:
        raise ValueError(f"storage {url!r}: fsspec knows no scheme {protocol!r} (e.g. s3://, gs://, az://)") from e
    except ImportError as e:  # fsspec's message names the package: "Install s3fs to access S3"
        raise ValueError(f"storage {url!r} needs a package that is not installed: {e}") from e
    return url.rstrip("/")


def _fs(location: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``location`` and the path on it (listings re-read, not cached)."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(location)
    fs.invalidate_cache(path)  # s3fs caches listings: another process may have written since
    return fs, path


# -- files -------------------------------------------------------------------------------------------------
def read_text(location: str) -> str | None:
    """The file's text, or ``None`` if there is no such file."""
    try:
        if not is_url(location):
            return Path(location).read_text()
        fs, path = _fs(location)
        return fs.cat_file(path).decode()
    except FileNotFoundError:
        return None


def write_text(location: str, text: str) -> None:
    """Replace the file whole: a rename of a temporary file locally, one PUT on an object store. The temporary
    file is this writer's own (two saves committing at once, e.g. an abandoned epoch's and the next one's, each
    replace ``latest`` whole instead of one renaming the other's half-written file or finding it gone)."""
    if not is_url(location):
        folder, name = os.path.split(location)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(text)
                _sync(f)
            os.replace(tmp, location)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        sync_folder(folder or ".")
        return
    fs, path = _fs(location)
    fs.pipe_file(path, text.encode())


def exists(location: str) -> bool:
    if not is_url(location):
        return os.path.exists(location)
    fs, path = _fs(location)
    return fs.exists(path)


def size(location: str) -> int:
    """The file's bytes."""
    if not is_url(location):
        return os.path.getsize(location)
    fs, path = _fs(location)
    return int(fs.size(path))


@contextlib.contextmanager
def open_file(location: str, mode: str) -> Iterator[IO[bytes]]:
    """A binary file to ``torch.save`` to or ``torch.load`` from (on an object store, the object is complete
    once the file is closed)."""
    if not is_url(location):
        with open(location, mode) as f:
            yield f
            if "r" not in mode:
                _sync(f)
        return
    fs, path = _fs(location)
    with fs.open(path, mode) as f:
        yield f


def _sync(f: IO[Any]) -> None:
    """The file's bytes on the disk, not only in the page cache: a checkpoint must outlive a power loss."""
    f.flush()
    os.fsync(f.fileno())


def sync_folder(folder: str) -> None:
    """The folder's entries (a file created or renamed in it) on the disk. A local folder only; a filesystem
    that cannot sync a directory (some network mounts) is left to its own guarantees."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def remove(location: str) -> None:
    """Delete the file or folder (with what it holds); nothing if there is none."""
    if not is_url(location):
        if os.path.isdir(location):
            shutil.rmtree(location, ignore_errors=True)
        elif os.path.lexists(location):
            os.unlink(location)
        return
    fs, path = _fs(location)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def probe_writable(root: str) -> None:
    """Write and delete a small file in ``root`` (made if a local folder), or raise ``OSError`` (or the
    filesystem library's error) saying why not. A URL's bucket is never created here."""
    if not is_url(root):
        Path(root).mkdir(parents=True, exist_ok=True)
    probe = join(root, f".meridian-write-test-{os.getpid()}")
    write_text(probe, "ok")
    if read_text(probe) != "ok":
        raise OSError(f"{probe} did not read back what was written")
    remove(probe)


# -- checkpoint folders ------------------------------------------------------------------------------------
def step_folders(root: str) -> dict[str, dict[str, int]]:
    """Every ``step-*`` folder under ``root``, complete or not: name → {file name: bytes}."""
    if not is_url(root):
        base = Path(root)
        if not base.is_dir():
            return {}
        found: dict[str, dict[str, int]] = {}
        for d in base.glob(PREFIX + "*"):
            try:  # a commit deletes old checkpoints while a listing (the artifacts', an export's) reads them
                if d.is_dir():
                    found[d.name] = {f.name: size for f in d.iterdir() if (size := _file_size(f)) is not None}
            except FileNotFoundError:  # the folder went meanwhile: it is not there
                continue
        return found
    fs, path = _fs(root)
    out: dict[str, dict[str, int]] = {}
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    for p, info in found.items():
        parts = p[len(path.rstrip("/")) + 1 :].split("/")
        if len(parts) == 2 and parts[0].startswith(PREFIX) and info.get("type") != "directory":
            out.setdefault(parts[0], {})[parts[1]] = int(info.get("size") or 0)
    return out


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint's folder name as a save writes it (``step-<digits>``): a copy such as
    ``step-00000040.bak`` someone left beside them is not one of the job's checkpoints."""
    digits = name.removeprefix(PREFIX)
    return name.startswith(PREFIX) and digits.isascii() and digits.isdigit()


def _file_size(path: Path) -> int | None:
    """The bytes of the regular file ``path``; ``None`` for anything else, or a file gone meanwhile."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def complete(folders: dict[str, dict[str, int]]) -> list[str]:
    """The names of the checkpoint folders that hold a marker, oldest first."""
    return sorted(name for name, files in folders.items()
                  if is_step_name(name) and any(m in files for m in MARKERS))  # fmt: skip


def is_complete(folder: str) -> bool:
    """Whether the checkpoint folder (or URL) holds its marker, i.e. every file of it was written."""
    return any(exists(join(folder, marker)) for marker in MARKERS)


def latest(root: str) -> str | None:
    """The name of the newest committed checkpoint: the one ``root/latest`` names while that folder is complete,
    else the newest complete folder; ``None`` if there is none. ``latest`` may name a folder that is gone or
    incomplete when a save of the step it names died between removing the old folder and renaming the new one
    into place (a resume after an older snapshot writes a step again), or when the pointer itself was lost;
    the newest complete checkpoint is then the one every reader trusts (every rank alike: a listing)."""
    text = read_text(join(root, LATEST))
    name = text.strip() if text else None
    if name and is_step_name(name) and is_complete(join(root, name)):
        return name
    done = complete(step_folders(root))
    return done[-1] if done else None


class CheckpointUnreadable(ValueError):
    """A complete checkpoint (its marker written) whose files do not read back: one cut short, missing, garbled,
    or (a URL) unreachable."""


def unreadable(folder: str, error: BaseException) -> CheckpointUnreadable:
    """The :class:`CheckpointUnreadable` of checkpoint ``folder`` that failed to read with ``error``: what
    failed, and what to do (which checkpoint a resume takes once this one's folder is gone)."""
    root, name = folder.rstrip("/").rsplit("/", 1) if is_url(folder) else os.path.split(folder.rstrip("/"))
    try:
        older = [n for n in complete(step_folders(root)) if n < name]
    except Exception:  # listing fails too (storage unreachable): the message still says what to do
        older = []
    then = (f"a resume then starts from {older[-1]}" if older
            else "there is no older checkpoint: a resume then starts at step 0")  # fmt: skip
    why = str(error) or "a file ends too early"
    return CheckpointUnreadable(
        f"the checkpoint {folder} cannot be read ({type(error).__name__}: {why}): a file of it is cut short, "
        "missing or garbled (a disk that filled, a copy or upload that stopped, a file edited or removed by hand), "
        f"or its storage is unreachable. If the storage is reachable, restore the folder from a copy, or delete it "
        f"({then})"
    )


# -- a save: where it writes, how it commits --------------------------------------------------------------
def writing_folder(root: str, name: str) -> str:
    """Where the files of checkpoint ``name`` are written before :func:`commit`."""
    return join(root, name) if is_url(root) else join(root, f".{name}.partial")


def prepare(root: str, name: str) -> str:
    """Clear what an earlier attempt at ``name`` left (one writer, before the others start), and for a URL
    take back a commit of ``name`` (``latest`` names the previous complete checkpoint meanwhile). Returns
    :func:`writing_folder`."""
    folder = writing_folder(root, name)
    if is_url(root) and latest(root) == name:
        older = [n for n in complete(step_folders(root)) if n < name]
        if older:
            write_text(join(root, LATEST), older[-1])
        else:
            remove(join(root, LATEST))
    for marker in MARKERS:  # first, so that no listing shows the folder while its files go
        remove(join(folder, marker))
    remove(folder)
    if not is_url(root):
        Path(root).mkdir(parents=True, exist_ok=True)
    return folder


def commit(root: str, name: str, written: str, *, keep: int) -> str:
    """Make the complete folder ``written`` (:func:`writing_folder`, its marker written last) the checkpoint
    ``root/name`` and ``latest``; delete all but the newest ``keep`` checkpoints and what crashed saves before
    this one left. Returns the checkpoint's folder."""
    final = join(root, name)
    if not is_url(root):
        if os.path.exists(final):
            shutil.rmtree(final)
        sync_folder(written)  # its files' entries, before the folder is named complete
        os.replace(written, final)
        sync_folder(root)  # the rename, before `latest` names it
    write_text(join(root, LATEST), name)  # the commit point
    folders = step_folders(root)
    done = complete(folders)
    for old in [n for n in done if n != name][: max(0, len(done) - keep)]:
        for marker in MARKERS:
            remove(join(root, old, marker))
        remove(join(root, old))
    for stale in sorted(set(folders) - set(done)):  # a URL's crashed saves (a folder not named as saves name
        if is_step_name(stale) and stale < name:  # theirs, e.g. someone's copy, is left alone)
            remove(join(root, stale))
    if not is_url(root):
        for partial in Path(root).glob(f".{PREFIX}*.partial"):  # a local folder's crashed saves
            if partial.name < f".{name}.partial":
                shutil.rmtree(partial, ignore_errors=True)
    return final


# -- proof that every node sees one storage ---------------------------------------------------------------
PROOF_FOLDER = ".meridian-shared"
"""Where the storage proof's tokens go, under the storage root."""


def write_token(root: str, nonce: str, node_id: str) -> str:
    """Write this node's token of proof ``nonce`` under ``root`` (a folder is made if local); its name. Run on
    each node by :mod:`meridian.service.cluster.storage_proof`."""
    folder = join(root, PROOF_FOLDER)
    if not is_url(root):
        Path(folder).mkdir(parents=True, exist_ok=True)
    name = f"{nonce}-{node_id[:16]}"
    write_text(join(folder, name), f"{nonce} {node_id}")
    return name


def read_tokens(root: str, nonce: str, names: list[str]) -> dict[str, bool]:
    """Which of the tokens ``names`` of proof ``nonce`` this process reads back as written (by any node)."""
    seen: dict[str, bool] = {}
    for name in names:
        try:
            text = read_text(join(root, PROOF_FOLDER, name))
        except Exception:  # noqa: BLE001 - unreadable here is what the proof finds out
            text = None
        seen[name] = bool(text) and text.split(" ", 1)[0] == nonce and name.startswith(nonce)
    return seen


def remove_tokens(root: str, names: list[str]) -> None:
    """Delete the proof's tokens that this process sees (its own, or every one on a shared storage)."""
    for name in names:
        with contextlib.suppress(Exception):
            remove(join(root, PROOF_FOLDER, name))


def list_files(location: str) -> dict[str, int]:
    """Every file under the folder (or URL) ``location``, by its path relative to it, with its bytes; ``{}`` when
    there is none."""
    if not is_url(location):
        out: dict[str, int] = {}
        for folder, _, names in os.walk(location):
            for name in names:
                path = os.path.join(folder, name)
                if (bytes_ := _file_size(Path(path))) is not None:
                    out[os.path.relpath(path, location)] = bytes_
        return out
    fs, path = _fs(location)
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    base = path.rstrip("/") + "/"
    return {p[len(base):]: int(info.get("size") or 0) for p, info in found.items()
            if p.startswith(base) and info.get("type") != "directory"}
