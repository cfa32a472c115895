"""The sparse outer-delta encoding: per-block top-k, 2-bit (or 4 / 8) values, packed positions.

SparseLoCo (Sarfi et al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo", arXiv:2508.15706)
sends, of each DiLoCo outer pseudo-gradient, only the largest few per cent of the entries of every chunk, each in
2 bits, and keeps what it did not send in an error-feedback accumulator that plays the outer momentum's part
(:class:`~meridian.workers.sync.compression.ErrorFeedback` with ``decay``). Here a payload of ``n`` fp32 values is
cut into blocks of ``block`` elements (the last one shorter), and each block keeps its
:func:`~meridian.workers.contracts.wire_format.sparse_kept` largest magnitudes:

    # 1) top-k of |x| in each block                     positions i (0 … block-1), values v
    # 2) magnitudes on 2^(bits-1) levels from the least to the largest kept |v|, and a sign bit
    # 3) [n | (least, largest) per block | codes, bits each | positions, log2(block) bits each]

A value decodes as ``±(least + level × (largest − least) / (levels − 1))`` at its position, zero elsewhere, so
what a block sends is exactly what its decoded values say and error feedback can carry the rest. The size depends
on ``n`` alone (:func:`~meridian.workers.contracts.wire_format.sparse_payload_bytes`), which lets the inter-DC
exchange post its receive before the data exists. Payloads cannot be summed on the wire: every receiver decodes
the datacenters' payloads and adds them in datacenter order (:func:`~meridian.workers.sync.compression.decode_sum`).

Non-finite values are selected first (they count as the largest), and a block holding one sends its largest
magnitude as NaN, so all its kept values decode as NaN: a diverged datacenter stops the job visibly, as with the
dense codecs, instead of error feedback carrying a finite stand-in forever.

Pure tensor code over one flat chunk: no collectives, no engine, no layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meridian.workers.contracts.config import DiLoCoConfig
from meridian.workers.contracts.wire_format import (
    SCALE_BYTES,
    SPARSE_HEADER_BYTES,
    SPARSE_SCALES_PER_BLOCK,
    sparse_index_bits,
    sparse_kept,
    sparse_payload_bytes,
)
from meridian.workers.sync.compression import decode_sum

VALUE_BITS = (2, 4, 8)
"""The value widths the codec packs: a sign bit and 1, 3 or 7 bits of magnitude level."""


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below ``2**width`` as a little-endian bit stream: bit j of value i is bit
    ``i * width + j`` of the stream, bit b of byte B is bit ``8B + b``; the last byte zero-padded."""
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=values.device)
    shifts = torch.arange(width, dtype=torch.int32, device=values.device)
    bits = ((values.to(torch.int32).reshape(-1, 1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)])
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.int32, device=values.device)
    return (bits.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` integers :func:`pack_bits` wrote at ``width`` bits each (int64)."""
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=packed.device)
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    bits = ((packed.to(torch.int32).reshape(-1, 1) >> shifts) & 1).reshape(-1)[: count * width]
    weights = torch.tensor([1 << b for b in range(width)], dtype=torch.int64, device=packed.device)
    return (bits.view(count, width).to(torch.int64) * weights).sum(dim=1)


@dataclass(frozen=True)
class SparseCodec:
    """Top-k per block of a flat fp32 chunk, values in ``value_bits`` bits, positions packed (module docstring)."""

    density: float
    """Share of each block's elements sent (``ceil(density × block)`` of them)."""
    value_bits: int = 2
    """Bits per kept value: one sign bit, the rest a magnitude level (2: two levels)."""
    block: int = 4096
    """Elements per top-k block; a position takes ``ceil(log2(block))`` bits."""

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"sparse density must be in (0, 1], got {self.density!r}")
        if self.value_bits not in VALUE_BITS:
            raise ValueError(f"sparse value_bits must be one of {VALUE_BITS}, got {self.value_bits!r}")
        if self.block < 2:
            raise ValueError(f"sparse block must be >= 2 elements, got {self.block!r}")

    @property
    def levels(self) -> int:
        """Magnitude levels a value can take (``2 ** (value_bits - 1)``)."""
        return 1 << (self.value_bits - 1)

    def payload_bytes(self, n: int) -> int:
        return sparse_payload_bytes(n, self.density, self.value_bits, self.block)

    def _rows(self, n: int) -> list[tuple[int, int, int, int]]:
        """``(first element, blocks, block length, kept per block)`` of the full blocks, then the short last one."""
        full, rest = divmod(n, self.block)
        out = [(0, full, self.block, sparse_kept(self.block, self.density))] if full else []
        if rest:
            out.append((full * self.block, 1, rest, sparse_kept(rest, self.density)))
        return out

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 values (n,) → the payload (uint8)."""
        x = x.float().reshape(-1)
        n = x.numel()
        scales, codes, positions = [], [], []
        for at, count, length, k in self._rows(n):
            rows = x[at : at + count * length].view(count, length)
            finite = torch.isfinite(rows)
            # 1) top-k of |x| per block; a non-finite value counts as the largest so it is sent, not kept back
            magnitude = torch.where(finite, rows.abs(), float("inf"))
            idx = magnitude.topk(k, dim=1).indices.sort(dim=1).values
            kept = rows.gather(1, idx)
            ok = torch.isfinite(kept)
            mags = torch.where(ok, kept.abs(), 0.0)
            # 2) magnitude levels between the least and the largest finite kept magnitude of the block
            least = torch.where(ok, kept.abs(), float("inf")).amin(dim=1, keepdim=True)
            least = torch.where(torch.isfinite(least), least, 0.0)
            largest = mags.amax(dim=1, keepdim=True)
            largest = torch.where(ok.all(dim=1, keepdim=True), largest, float("nan"))
            step = (largest - least) / (self.levels - 1)
            level = torch.where(step > 0, torch.round((mags - least) / step), 0.0).clamp_(0, self.levels - 1)
            sign = (kept < 0).to(torch.int64)
            scales.append(torch.cat([least, largest], dim=1).reshape(-1))
            codes.append((level.to(torch.int64) + sign * self.levels).reshape(-1))
            positions.append(idx.reshape(-1))
        header = torch.tensor([n], dtype=torch.int32, device=x.device).view(torch.uint8)
        if not scales:  # an empty chunk: the header alone
            return header
        # 3) header | scales | codes | positions
        return torch.cat([
            header, torch.cat(scales).view(torch.uint8), pack_bits(torch.cat(codes), self.value_bits),
            pack_bits(torch.cat(positions), sparse_index_bits(self.block)),
        ])  # fmt: skip

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """One payload → fp32 values (n,): the kept values at their positions, zeros elsewhere."""
        n = int(payload[:SPARSE_HEADER_BYTES].clone().view(torch.int32))
        rows = self._rows(n)
        blocks = sum(count for _, count, _, _ in rows)
        kept = sum(count * k for _, count, _, k in rows)
        at = SPARSE_HEADER_BYTES
        scales = payload[at : at + blocks * SPARSE_SCALES_PER_BLOCK * SCALE_BYTES].clone().view(torch.float32)
        at += scales.numel() * SCALE_BYTES
        code_bytes = -(-kept * self.value_bits // 8)
        codes = unpack_bits(payload[at : at + code_bytes], self.value_bits, kept)
        positions = unpack_bits(payload[at + code_bytes :], sparse_index_bits(self.block), kept)
        out = torch.zeros(n, dtype=torch.float32, device=payload.device)
        scales = scales.view(blocks, SPARSE_SCALES_PER_BLOCK)
        b = v = 0
        for first, count, length, k in rows:
            least, largest = scales[b : b + count, :1], scales[b : b + count, 1:]
            step = (largest - least) / (self.levels - 1)
            code = codes[v : v + count * k].view(count, k)
            magnitude = least + (code % self.levels).float() * step
            values = torch.where(code >= self.levels, -magnitude, magnitude)
            out[first : first + count * length].view(count, length).scatter_(1, positions[v : v + count * k].view(count, k), values)
            b, v = b + count, v + count * k
        return out

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        """(k, payload) payloads of the k datacenters → their fp32 sum, added in row order on every rank."""
        return decode_sum(self, gathered)

    @property
    def name(self) -> str:
        """The encoding's name in saved error-feedback state: residuals of any density or width carry over (they
        are what was not sent), not those of a dense encoding."""
        return "sparse"


def sparse_codec_of(cfg: DiLoCoConfig) -> SparseCodec | None:
    """The codec ``cfg``'s sparse knobs ask for; ``None`` where the outer update is dense."""
    if cfg.sparse_density is None:
        return None
    return SparseCodec(density=cfg.sparse_density, value_bits=cfg.sparse_value_bits, block=cfg.sparse_block)
