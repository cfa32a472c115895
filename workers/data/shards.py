"""Training batches read from prepared datasets' memory-mapped token shards.

Nothing here reads a dataset whole: shards are memory-mapped, a batch copies only its own windows (and
unmaps what the read faulted in, :class:`TokenStream`), and the sample order is computed per sample, not
stored. Sample order is, as for
:class:`~meridian.workers.data.text.TextDataset`, a pure function of (seed, global sample index), so
:meth:`TokenDataset.step_batches` gives a step the same samples whatever the number of ranks:

- a dataset's window ``i`` of epoch ``e`` is ``perm_e(i)``, a keyed bijection on ``[0, num_samples)``
  (a Feistel network with cycle walking: O(1) memory, unlike a stored permutation of every window);
- a blend cuts the global sample stream into blocks of :data:`BLEND_BLOCK` samples; each block holds
  exactly each dataset's share (largest remainder), at positions shuffled per block, so the weights are
  honoured in every block and dataset ``d``'s ``k``-th sample is found without counting earlier blocks.
"""

from __future__ import annotations

import functools
import mmap
import os

import numpy as np
import torch

from meridian.workers.contracts.config import DataConfig, DataPin
from meridian.workers.data.manifest import (
    Manifest,
    check_pinned,
    check_shard_size,
    open_dataset_file,
    read_manifest,
)
from meridian.workers.data.remote import local_datasets
from meridian.workers.data.text import StepSampled, TextDataset, TooFewTokens

BLEND_BLOCK = 4096
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A 64-bit mixing function (splitmix64's finaliser) of ``x`` xor ``key``; uint64 in, uint64 out."""
    z = x ^ np.uint64(key & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A keyed pseudo-random bijection of ``[0, n)``, evaluated per index in O(1) memory."""

    ROUNDS = 4

    def __init__(self, n: int, key: int) -> None:
        self.n = n
        bits = max(2, (max(1, n - 1)).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [int(_mix(np.array([key * 8 + r], dtype=np.uint64), 0x9E3779B97F4A7C15)[0]) for r in
                     range(self.ROUNDS)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right, k) & self.mask)
        return (left << h) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        x = np.asarray(idx, dtype=np.uint64)
        with np.errstate(over="ignore"):
            x = self._round_trip(x)
            out = x >= np.uint64(self.n)
            while out.any():  # cycle walking: re-encrypt until inside [0, n) (expected < 4 rounds)
                x[out] = self._round_trip(x[out])
                out = x >= np.uint64(self.n)
        return x.astype(np.int64)


class TokenStream:
    """One split of a prepared dataset: its shards memory-mapped end to end.

    A read faults in the pages it touches, and the kernel may map far more than that around them (a whole
    large folio of the page cache: 2 MiB). Left mapped, those pages count in the worker's resident set
    until it spans the whole dataset (measured: +196 MB after 640 random windows of a 200 MB shard), so
    every read hands its surrounding :data:`RELEASE_ALIGN` region back (``MADV_DONTNEED``: the pages leave
    this process's page tables and stay in the page cache, so a re-read costs no I/O)."""

    RELEASE_ALIGN = 1 << 21

    def __init__(self, directory: str, split: str, pin: DataPin | None = None) -> None:
        self.directory = directory
        self.manifest: Manifest = read_manifest(directory)
        check_pinned(directory, self.manifest, pin)  # before anything is read from it
        s = self.manifest.split(split)
        dtype = np.dtype(self.manifest.dtype)
        self.itemsize = dtype.itemsize
        self.maps: list[mmap.mmap] = []
        self.shards: list[np.ndarray] = []
        for sh in s.shards:
            # A plain name opened without following a symlink: the service admitted the directory, not where
            # a link inside it might point.
            fd = open_dataset_file(directory, sh.file)
            try:
                check_shard_size(directory, self.manifest, sh, os.fstat(fd).st_size)
                if sh.tokens:
                    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                    self.maps.append(mm)
                    self.shards.append(np.frombuffer(mm, dtype=dtype))
            finally:
                os.close(fd)
        self.bounds = np.cumsum([0] + [len(m) for m in self.shards])
        self.tokens = int(self.bounds[-1])

    def _release(self, shard: int, start: int, stop: int) -> None:
        """Unmap the region around tokens ``[start, stop)`` of a shard from this process (not from the cache)."""
        mm, align = self.maps[shard], self.RELEASE_ALIGN
        lo = (start * self.itemsize) // align * align
        hi = min(len(mm), -(-(stop * self.itemsize) // align) * align)
        if hasattr(mm, "madvise") and hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the split (as int64), across shard boundaries."""
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self.bounds, start, side="right")) - 1
        pos, filled = start - int(self.bounds[i]), 0
        while filled < length:
            chunk = self.shards[i][pos: pos + length - filled]
            out[filled: filled + len(chunk)] = chunk
            self._release(i, pos, pos + len(chunk))
            filled += len(chunk)
            i, pos = i + 1, 0
        return out


class _Source:
    """Fixed-length windows of one dataset's split, in a seeded per-epoch order (or in order: ``shuffle``)."""

    def __init__(self, directory: str, split: str, seq_len: int, seed: int, index: int, shuffle: bool,
                 pin: DataPin | None = None) -> None:
        self.stream = TokenStream(directory, split, pin)
        self.seq_len, self.seed, self.index, self.shuffle = seq_len, seed, index, shuffle
        self.num_samples = (self.stream.tokens - 1) // seq_len
        if self.num_samples < 1:
            raise TooFewTokens(
                f"dataset {directory!r} has {self.stream.tokens} {split} tokens, too few for one sample of "
                f"model.seq_len={seq_len} tokens; prepare more text (or a larger --val-fraction) or shorten seq_len"
            )

    @functools.lru_cache(maxsize=4)  # noqa: B019 - one source per dataset, lives as long as the run
    def _perm(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.num_samples, (self.seed * 1_000_003 + epoch) * 131 + self.index)

    def window_ids(self, sample: np.ndarray) -> np.ndarray:
        epoch, i = np.divmod(sample, self.num_samples)
        if not self.shuffle:
            return i
        out = np.empty_like(i)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._perm(int(e))(i[sel])
        return out

    def windows(self, window_ids: np.ndarray) -> np.ndarray:
        rows = np.stack([self.stream.read(int(w) * self.seq_len, self.seq_len + 1) for w in window_ids])
        top, vocab = int(rows.max()), self.stream.manifest.vocab_size
        if top >= vocab:  # the service admitted the model by the manifest's vocab_size: an id past it has no row
            raise ValueError(f"dataset {self.stream.directory!r} holds token id {top} but its manifest declares a "
                             f"vocab_size of {vocab} (the model was admitted by that figure, an id past it has no "
                             "embedding row); prepare the dataset again")
        return rows


class TokenDataset(StepSampled):
    """The :class:`TextDataset` interface (``batch``, ``step_batches``, ``num_samples``) over prepared
    datasets: one, or a weighted blend."""

    def __init__(self, datasets: tuple[tuple[str, float], ...], seq_len: int, seed: int, *,
                 split: str = "train", pins: tuple[DataPin, ...] = ()) -> None:
        shuffle = split == "train"  # held-out batches are the split's first windows, in order
        pinned = {p.path: p for p in pins}
        self.sources = [_Source(d, split, seq_len, seed, i, shuffle, pinned.get(d)) for i, (d, _) in enumerate(datasets)]
        self.weights = [w for _, w in datasets]
        self.seq_len, self.seed = seq_len, seed
        self.vocab_size = max(s.stream.manifest.vocab_size for s in self.sources)
        self.num_samples = sum(s.num_samples for s in self.sources)
        # Samples of each dataset per block (largest remainder: they sum to the block exactly).
        raw = [w * BLEND_BLOCK for w in self.weights]
        quota = [int(r) for r in raw]
        for i in sorted(range(len(raw)), key=lambda i: quota[i] - raw[i])[: BLEND_BLOCK - sum(quota)]:
            quota[i] += 1
        self.quota = np.array(quota, dtype=np.int64)
        self.quota_end = np.cumsum(self.quota)

    def assign(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, dataset's own sample index)`` of global samples ``first .. first + count - 1``."""
        g = np.arange(first, first + count, dtype=np.int64)
        if len(self.sources) == 1:
            return np.zeros_like(g), g
        block, pos = np.divmod(g, BLEND_BLOCK)
        slot = np.empty_like(pos)
        for b in np.unique(block):
            sel = block == b
            slot[sel] = FeistelPermutation(BLEND_BLOCK, self.seed * 7_919 + int(b))(pos[sel])
        which = np.searchsorted(self.quota_end, slot, side="right")
        within = slot - (self.quota_end[which] - self.quota[which])
        return which, block * self.quota[which] + within

    def sample_ids(self, first: int, count: int) -> list[tuple[int, int]]:
        """``(dataset, window)`` of global samples ``first .. first + count - 1``."""
        which, local = self.assign(first, count)
        out: list[tuple[int, int]] = [(0, 0)] * count
        for d, src in enumerate(self.sources):
            sel = np.nonzero(which == d)[0]
            if len(sel):
                for j, w in zip(sel, src.window_ids(local[sel]), strict=True):
                    out[j] = (d, int(w))
        return out

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for global samples ``first .. first + count - 1``: (count, seq_len)."""
        rows = np.empty((count, self.seq_len + 1), dtype=np.int64)
        ids = self.sample_ids(first, count)
        for d, src in enumerate(self.sources):
            sel = [j for j, (dd, _) in enumerate(ids) if dd == d]
            if sel:
                rows[sel] = src.windows(np.array([ids[j][1] for j in sel]))
        windows = torch.from_numpy(rows)
        return windows[:, :-1], windows[:, 1:]


Dataset = TextDataset | TokenDataset


def make_dataset(cfg: DataConfig, seq_len: int, seed: int, *, split: str = "train") -> Dataset:
    """The dataset a job's ``data`` config names: prepared token shards (``dataset``/``blend``) or the text
    ``source``. ``split``: ``train``, or ``eval`` (the held-out part)."""
    if cfg.datasets:
        # A dataset named by URL is read from this host's verified copy (fetched where missing or damaged).
        datasets, pins = local_datasets(cfg)
        return TokenDataset(datasets, seq_len, seed, split="train" if split == "train" else "val", pins=pins)
    return TextDataset(cfg, seq_len, seed, split=split)
