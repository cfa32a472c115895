"""Prepared datasets named by URL (``s3://bucket/prefix``, ``file:///path``): read through fsspec into a cache
on each node, every shard checked against the SHA-256 its manifest gives before training reads it; torch-free.

The service admits a URL only under a root its operator declared (:mod:`meridian.service.locations`) and pins
the manifest it found (``data.pins``). A worker then calls :func:`local_copy` before it trains (the Ray worker's
agent, at its start: a node that cannot reach the data fails the job at placement, naming itself), and the
training process opens the copy as it opens any prepared dataset directory (:func:`local_datasets`). A cached
shard whose bytes no longer hash to the manifest's figure (a disk error, someone's edit) is fetched again; a
fetched one that does not match either is refused (the store holds a damaged copy).

The cache lives in ``$XDG_CACHE_HOME/meridian/datasets`` (``~/.cache/meridian/datasets``), one folder per URL and
manifest key, shared by the workers of one host under a lock. Credentials and endpoints come from the
environment, as fsspec's filesystem reads them (for S3: ``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL`` …). Must never
write outside its cache folder: the manifest's file names are plain names (:func:`~meridian.workers.data.manifest.
is_plain_name`), checked before anything is fetched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from meridian.workers.contracts.config import DataConfig, DataPin
from meridian.workers.data.manifest import (
    DTYPES,
    MANIFEST,
    Manifest,
    check_pinned,
    is_url,
    parse_manifest,
    read_manifest,
)

CHUNK = 8 << 20
"""Bytes read and hashed at a time while a shard is fetched or checked."""
LOCK_TIMEOUT_S = 3600.0
"""How long a worker waits for another process of its host that fetches the same dataset (a large dataset over a
slow link takes long; past this something is stuck)."""
STAMP = ".verified.json"
"""The cached files' size, mtime and inode right after they were hashed: a training process trusts a copy whose
files still match it, so only a worker's start re-reads every byte."""


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "meridian", "datasets")


def cache_dir(url: str, manifest_key: str) -> str:
    """The folder of ``url``'s copy as prepared with ``manifest_key``: a new preparation gets a new folder."""
    name = f"{hashlib.sha256(url.encode()).hexdigest()[:20]}-{manifest_key[:16]}"
    return os.path.join(cache_root(), name)


def _fs(url: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)  # s3fs caches listings: the dataset may have been written since
    return fs, path


def _unreadable(url: str, e: BaseException) -> ValueError:
    return ValueError(f"dataset {url} cannot be read ({type(e).__name__}: {e}); check this machine's credentials "
                      "and endpoint for it (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)")


def read_remote_manifest(url: str) -> Manifest:
    """``url``'s manifest, checked as a local one is; ``ValueError`` saying what is wrong."""
    where = f"{url.rstrip('/')}/{MANIFEST}"
    try:
        fs, path = _fs(url)
        text = fs.cat_file(f"{path.rstrip('/')}/{MANIFEST}")
    except FileNotFoundError:
        raise ValueError(f"{url!r} is not a prepared dataset (no {MANIFEST}); write one there with `meridian data "
                         "prepare ... --out DIR` and copy DIR's files to it") from None
    except Exception as e:  # noqa: BLE001 - each filesystem library raises its own types
        raise _unreadable(url, e) from None
    return parse_manifest(text, where)


def manifest_of(location: str) -> Manifest:
    """The manifest of a prepared dataset named by its directory or by its URL."""
    return read_remote_manifest(location) if is_url(location) else read_manifest(location)


def check_remote_files(url: str, manifest: Manifest) -> None:
    """At admission: every shard the manifest names is there with the size its token count makes and carries
    the hash a node's copy is checked against; ``ValueError`` naming the first that does not."""
    fs, path = _fs(url)
    for split in (manifest.train, manifest.val):
        for sh in split.shards:
            if not sh.sha256:
                raise ValueError(f"dataset {url!r}: its manifest gives no SHA-256 of shard {sh.file} (it was prepared "
                                 "by an older Meridian); a dataset read by URL needs them: prepare it again with "
                                 "`meridian data prepare` and copy it there")
            try:
                size = int(fs.info(f"{path.rstrip('/')}/{sh.file}")["size"])
            except FileNotFoundError:
                raise ValueError(f"dataset {url!r}: shard {sh.file} is missing; copy the whole prepared "
                                 "directory there") from None
            except Exception as e:  # noqa: BLE001
                raise _unreadable(url, e) from None
            expected = sh.tokens * DTYPES[manifest.dtype]
            if size != expected:
                raise ValueError(f"dataset {url!r}: shard {sh.file} has {size} bytes, the manifest says {expected}; "
                                 "copy it again")


@dataclass(frozen=True)
class CachedDataset:
    directory: str
    """The local folder holding the verified copy (a prepared dataset directory)."""
    fetched: tuple[str, ...] = ()
    """Shards fetched now because the cache had none."""
    refetched: tuple[str, ...] = ()
    """Shards fetched again because the cached copy did not hash to the manifest's figure."""


def _sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            h = hashlib.sha256()
            while chunk := f.read(CHUNK):
                h.update(chunk)
            return h.hexdigest()
    except FileNotFoundError:
        return None


def _stat_key(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _stamp_valid(directory: str, manifest: Manifest) -> bool:
    try:
        with open(os.path.join(directory, STAMP), encoding="utf-8") as f:
            stamp = json.load(f)
        return all(stamp.get(sh.file) == _stat_key(os.path.join(directory, sh.file))
                   for split in (manifest.train, manifest.val) for sh in split.shards)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(directory: str, url: str) -> Iterator[None]:
    """The host's lock of one cached dataset: workers of one host fetch it once, one after another."""
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    fd = os.open(directory + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process of this host has held the cache lock of dataset {url} for "
                                       f"{LOCK_TIMEOUT_S:.0f} s ({directory}.lock); if none is fetching it, "
                                       "delete the lock file") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def _fetch(fs: Any, remote: str, local: str, want: str, url: str, name: str) -> None:
    part = local + ".part"
    h = hashlib.sha256()
    try:
        with fs.open(remote, "rb") as src, open(part, "wb") as dst:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                dst.write(chunk)
    except Exception as e:  # noqa: BLE001 - each filesystem library raises its own types
        with contextlib.suppress(OSError):
            os.unlink(part)
        if isinstance(e, FileNotFoundError):
            raise ValueError(f"dataset {url}: shard {name} is missing from the store") from None
        raise _unreadable(url, e) from None
    if h.hexdigest() != want:
        os.unlink(part)
        raise ValueError(f"dataset {url}: shard {name} as fetched hashes to {h.hexdigest()[:12]}..., its manifest "
                         f"says {want[:12]}...: the store holds a damaged or changed copy; copy the prepared "
                         "directory there again")
    os.replace(part, local)


def local_copy(url: str, pin: DataPin | None = None, *, trust_stamp: bool = False) -> CachedDataset:
    """A verified copy of the dataset at ``url`` in this host's cache, fetched where missing or damaged.
    ``pin``: what the service admitted (a manifest prepared again since is refused). ``trust_stamp``: a copy
    whose files are unchanged since they were last hashed is used as it is (a training process; a worker's
    start hashes every byte again)."""
    if trust_stamp and pin is not None and pin.manifest_key:
        directory = cache_dir(url, pin.manifest_key)
        with contextlib.suppress(ValueError):
            manifest = _cached_manifest(directory)
            if manifest is not None and manifest.key == pin.manifest_key and _stamp_valid(directory, manifest):
                return CachedDataset(directory)
    manifest = read_remote_manifest(url)
    check_pinned(url, manifest, pin)
    directory = cache_dir(url, manifest.key)
    fs, root = _fs(url)
    fetched: list[str] = []
    refetched: list[str] = []
    with _locked(directory, url):
        os.makedirs(directory, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # stale from here on, until rewritten below
            os.unlink(os.path.join(directory, STAMP))
        for split in (manifest.train, manifest.val):
            for sh in split.shards:
                if not sh.sha256:
                    raise ValueError(f"dataset {url!r}: its manifest gives no SHA-256 of shard {sh.file}; prepare it "
                                     "again with `meridian data prepare`")
                local = os.path.join(directory, sh.file)
                have = _sha256(local)
                if have == sh.sha256:
                    continue
                (fetched if have is None else refetched).append(sh.file)
                _fetch(fs, f"{root.rstrip('/')}/{sh.file}", local, sh.sha256, url, sh.file)
        _write(os.path.join(directory, MANIFEST), json.dumps(manifest.to_dict(), indent=2))
        _write(os.path.join(directory, STAMP), json.dumps(
            {sh.file: _stat_key(os.path.join(directory, sh.file))
             for split in (manifest.train, manifest.val) for sh in split.shards}))
    return CachedDataset(directory, tuple(fetched), tuple(refetched))


def _cached_manifest(directory: str) -> Manifest | None:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            return parse_manifest(f.read(), path)
    except FileNotFoundError:
        return None


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def url_datasets(data: DataConfig) -> list[str]:
    """The datasets of ``data`` named by URL."""
    return [d for d, _ in data.datasets if is_url(d)]


def local_datasets(data: DataConfig, *, trust_stamp: bool = True) -> tuple[tuple[tuple[str, float], ...],
                                                                            tuple[DataPin, ...]]:
    """``data.datasets`` and ``data.pins`` with every URL replaced by its verified local copy (paths as they are)."""
    datasets, pins = [], list(data.pins)
    for directory, weight in data.datasets:
        if is_url(directory):
            pin = data.pin(directory)
            local = local_copy(directory, pin, trust_stamp=trust_stamp).directory
            pins = [replace(p, path=local) if p.path == directory else p for p in pins]
            directory = local
        datasets.append((directory, weight))
    return tuple(datasets), tuple(pins)


class DataUnreachable(RuntimeError):
    """A node cannot copy a job's dataset (no credentials, no route, a damaged store): the job cannot train."""


def cache_url_datasets(data: DataConfig, *, worker_id: str, node_id: str, datacenter: str, host: str,
                       on_event: Callable[[str, str, dict[str, Any]], Any]) -> None:
    """What a worker does before it joins: copy every dataset of ``data`` named by URL into this host's cache,
    every shard hashed (:func:`local_copy`), each copy a ``dataset_cached`` event; :class:`DataUnreachable` naming
    the node, its host and the reason when one cannot be."""
    for url in url_datasets(data):
        try:
            copy = local_copy(url, data.pin(url))
        except Exception as e:  # noqa: BLE001 - whatever stops the copy stops the job, with its reason
            raise DataUnreachable(f"node {node_id[:12]} ({host}, datacenter {datacenter}) cannot read the job's "
                                  f"dataset {url}: {e}") from e
        what = (f"fetched {len(copy.fetched)} shard(s)" if copy.fetched else "found it whole") + (
            f", fetched {len(copy.refetched)} damaged shard(s) again" if copy.refetched else "")
        on_event("dataset_cached", f"worker {worker_id[:12]} in {datacenter} cached {url}: {what}", {
            "url": url, "worker_id": worker_id, "node_id": node_id, "datacenter": datacenter,
            "directory": copy.directory, "fetched": list(copy.fetched), "refetched": list(copy.refetched)})
