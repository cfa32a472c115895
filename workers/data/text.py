"""Training text and a sample order that does not depend on how many workers share it.

The built-in corpus is the Python Language Reference as ``help()`` shows it (``pydoc_data.topics``,
shipped with every CPython), so every machine has the same real text offline. A job may name a local
UTF-8 file instead. Text is tokenised as bytes (vocabulary 256).

Sample order is a pure function of (seed, global sample index): step ``s`` trains on global samples
``[s * B, (s + 1) * B)`` of a per-epoch permutation, and each data-parallel rank takes a contiguous slice
of that range. Changing the number of ranks (a node lost, a node back) changes who computes which sample,
never which samples a step sees, so no sample is skipped or repeated because of a resize.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.source import read_source, source_sha256, split_bytes

BUILTIN_PYTHON_REFERENCE = "builtin:python-reference"


class TooFewTokens(ValueError):
    """A split holds fewer than ``seq_len + 1`` tokens: not one sample. The training loop skips its final
    evaluation on such a held-out split instead of losing the trained run."""


def load_text(cfg: DataConfig) -> bytes:
    """The corpus as bytes, capped at ``cfg.max_bytes``. Raises ``ValueError`` a person can act on."""
    if cfg.source == BUILTIN_PYTHON_REFERENCE:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    else:
        path = cfg.source
        if not os.path.isabs(path):
            raise ValueError(f"data.source must be an absolute path or {BUILTIN_PYTHON_REFERENCE!r}, got {path!r}")
        text = read_source(path, cfg.max_bytes)  # no symlink, no pipe: regular files only
        pin = cfg.pin(path)
        if pin is not None and pin.sha256 and source_sha256(text) != pin.sha256:
            raise ValueError(
                f"data.source {path!r} changed after this job was submitted (its first {len(text)} bytes are not "
                "those the service admitted): training on it would change which samples every step reads mid-job. "
                "Put the file back as it was, or submit a new job; write new text to a new file")
    return text[: cfg.max_bytes]


@functools.lru_cache(maxsize=4)
def _tokens(cfg: DataConfig) -> torch.Tensor:
    return torch.frombuffer(bytearray(load_text(cfg)), dtype=torch.uint8).long()


@dataclass(frozen=True)
class Slice:
    """A contiguous range ``[start, stop)`` of a step's global batch."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def rank_slice(global_batch: int, dp_rank: int, dp_size: int) -> Slice:
    """This rank's share of a step's samples: sizes differ by at most one across ranks."""
    base, extra = divmod(global_batch, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return Slice(start, start + base + (1 if dp_rank < extra else 0))


def micro_batch_sizes(share: int, global_batch: int, micro_batch: int, dp_size: int) -> list[int]:
    """A share of ``share`` samples cut into micro-batches of at most ``micro_batch``, as many on every rank: the
    largest share's count (sharded parameters are gathered and reduced inside a datacenter once per micro-batch,
    so every rank must run the same number). A smaller share's last ones are shorter, or empty."""
    largest = math.ceil(global_batch / dp_size)
    count = math.ceil(largest / micro_batch)
    sizes = [min(micro_batch, max(0, share - i * micro_batch)) for i in range(count)]
    assert sum(sizes) == share
    return sizes


class StepSampled:
    """A dataset whose global sample ``g`` is fixed by (seed, g): a step's batch is samples
    ``step * global_batch ..``, each rank reading its slice, so any resize reads the same samples."""

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def step_batches(
        self, step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, *, uniform: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for optimizer step ``step``: its share cut into micro-batches of at most
        ``micro_batch`` samples (none for an empty share); with ``uniform``, as many as every other rank has
        (:func:`micro_batch_sizes`)."""
        share = rank_slice(global_batch, dp_rank, dp_size)
        first = step * global_batch + share.start
        sizes = (micro_batch_sizes(len(share), global_batch, micro_batch, dp_size) if uniform
                 else [min(micro_batch, len(share) - off) for off in range(0, len(share), micro_batch)])
        out, at = [], first
        for n in sizes:
            out.append(self.batch(at, n))
            at += n
        return out


class TextDataset(StepSampled):
    """Fixed-length windows of the token stream, in a seeded per-epoch order."""

    def __init__(self, cfg: DataConfig, seq_len: int, seed: int, *, split: str = "train") -> None:
        tokens = _tokens(cfg)
        start, stop = split_bytes(len(tokens), split)
        self.tokens = tokens[start:stop]
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise TooFewTokens(
                f"data.source has {len(tokens)} bytes, too few for one {split} sample of "
                f"model.seq_len={seq_len} tokens; use a bigger file or a shorter seq_len"
            )

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one dataset per worker, lives as long as the run
    def _epoch_order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def sample_ids(self, first: int, count: int) -> list[int]:
        """Window ids of global samples ``first .. first + count - 1``."""
        out = []
        for g in range(first, first + count):
            epoch, i = divmod(g, self.num_samples)
            out.append(int(self._epoch_order(epoch)[i]))
        return out

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for global samples ``first .. first + count - 1``: (count, seq_len)."""
        starts = torch.tensor(self.sample_ids(first, count), dtype=torch.long) * self.seq_len
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets[None, :]]
        return windows[:, :-1], windows[:, 1:]
