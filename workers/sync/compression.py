"""Wire encodings for the inter-DC step, and the error feedback that keeps them unbiased over time.

- :class:`Bf16Codec`: round to bfloat16 (2 bytes per element). bf16 values can be summed on the wire.
- :class:`Int8Codec`: one absmax scale per chunk, ``q = round(x / scale)`` in [-127, 127], 1 byte per
  element plus a 4-byte fp32 scale. int8 values cannot be summed on the wire (they overflow, and every
  sender has its own scale), so the receivers all-gather the payloads and sum after decoding.
- :class:`Int4Codec`: blocks of ``INT4_BLOCK`` elements, one absmax scale each, ``q = round(x / scale)`` in
  [-7, 7] packed two to a byte: ``0.5 + 4 / INT4_BLOCK`` bytes per element plus a 4-byte length header.
  Like int8 it cannot be summed on the wire: receivers all-gather and sum after decoding. Meant for outer
  DiLoCo deltas (streaming DiLoCo quantises them to 4 bits, Douillard et al. 2025, arXiv:2501.18512 §3),
  where error feedback carries what one sync rounds away into the next.
- Non-finite values: the int8 and int4 scales are the absmax of the *finite* values, and a NaN or infinity
  goes out as a code no finite value uses (int8: -128; int4: nibble 0) and decodes as NaN. It reaches the sum as
  it does uncompressed or in bf16, so a diverged datacenter stops the job visibly; a scale taken over a NaN
  (1) would have sent it as 0 (int8) or -8 (int4), and error feedback would have kept sending that finite
  value every step after.
- :class:`ErrorFeedback`: keeps, per rank and per chunk, what the encoding lost (``x - decode(encode(x))``)
  and adds it to the next step's value of that chunk before encoding (Seide et al. 2014, "1-bit SGD";
  Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"). Summed over steps, what was sent differs
  from what should have been sent by one residual only, instead of an error that grows with the steps.

Pure tensor code: no collectives, no process groups, so the maths is tested on its own.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import torch

from meridian.workers.contracts.config import Compression
from meridian.workers.contracts.wire_format import (
    INT4_BLOCK,
    INT4_HEADER_BYTES,
    SCALE_BYTES,
    int4_payload_bytes,
    int8_payload_bytes,
)

INT8_LEVELS = 127
INT4_LEVELS = 7
INT8_NOT_FINITE = -128
"""The int8 code of a NaN or infinity (finite values use -127…127); it decodes as NaN."""
INT4_NOT_FINITE = 0
"""The int4 nibble of a NaN or infinity (finite values use 1…15, ``q + 8``); it decodes as NaN."""


def _positive(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` where it is > 0, else 1: all zeros, or an absmax so small that absmax / levels underflows to 0
    (x / 0 would be NaN, and NaN's code is the non-finite one)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


class Codec(Protocol):
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 values (n,) → the payload that goes on the wire."""
        ...

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """One payload → fp32 values (n,)."""
        ...

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        """(k, payload) payloads of the k datacenters → their fp32 sum, added in row order on every rank."""
        ...


class Bf16Codec:
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.float()

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        """(k, n) bf16 payloads of the k datacenters → their fp32 sum, added in row order on every rank."""
        return decode_sum(self, gathered)


class Int8Codec:
    """``[q_0 … q_{n-1} | scale]`` as n + 4 bytes (uint8 on the wire: every backend carries bytes)."""

    def payload_bytes(self, n: int) -> int:
        return int8_payload_bytes(n)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        finite = torch.isfinite(x)
        magnitude = torch.where(finite, x.abs(), 0.0)
        absmax = magnitude.max() if x.numel() else x.new_zeros(())
        scale = _positive(absmax / INT8_LEVELS).reshape(1)
        q = torch.round(x / scale).clamp_(-INT8_LEVELS, INT8_LEVELS)
        q = torch.where(finite, q, float(INT8_NOT_FINITE)).to(torch.int8)
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)])

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        q = payload[:-SCALE_BYTES].view(torch.int8)
        scale = payload[-SCALE_BYTES:].clone().view(torch.float32)
        return torch.where(q == INT8_NOT_FINITE, float("nan"), q.float() * scale)

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        """(k, n + 4) payloads of the k datacenters → their fp32 sum, added in row order on every rank."""
        return decode_sum(self, gathered)


class Int4Codec:
    """``[n (int32) | nibbles, two per byte | one fp32 scale per block]``; the last block is zero-padded.

    Nibble ``q + 8`` (1…15) for ``q`` in [-7, 7], 0 for a non-finite value; the even element of a pair sits in the
    low nibble."""

    def __init__(self, block: int = INT4_BLOCK) -> None:
        if block < 2 or block % 2:
            raise ValueError(f"int4 block must be an even number >= 2, got {block}")
        self.block = block

    def payload_bytes(self, n: int) -> int:
        return int4_payload_bytes(n, self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().reshape(-1)
        n = x.numel()
        blocks = -(-n // self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x
        rows = padded.view(blocks, self.block)
        finite = torch.isfinite(rows)
        absmax = torch.where(finite, rows.abs(), 0.0).amax(dim=1, keepdim=True)
        scale = _positive(absmax / INT4_LEVELS)
        q = torch.round(rows / scale).clamp_(-INT4_LEVELS, INT4_LEVELS) + 8
        q = torch.where(finite, q, float(INT4_NOT_FINITE)).to(torch.uint8).view(-1, 2)
        packed = q[:, 0] | (q[:, 1] << 4)
        header = torch.tensor([n], dtype=torch.int32, device=x.device).view(torch.uint8)
        return torch.cat([header, packed, scale.reshape(-1).view(torch.uint8)])

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        n = int(payload[:INT4_HEADER_BYTES].clone().view(torch.int32))
        blocks = -(-n // self.block)
        body = payload[INT4_HEADER_BYTES : INT4_HEADER_BYTES + blocks * self.block // 2]
        scales = payload[INT4_HEADER_BYTES + body.numel() :].clone().view(torch.float32).view(blocks, 1)
        nibbles = torch.stack([body & 0x0F, body >> 4], dim=1).view(blocks, self.block)
        values = torch.where(nibbles == INT4_NOT_FINITE, float("nan"), (nibbles.float() - 8) * scales)
        return values.reshape(-1)[:n]

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        """(k, payload) payloads of the k datacenters → their fp32 sum, added in row order on every rank."""
        return decode_sum(self, gathered)


def payload_nbytes(compression: Compression, n: int) -> int:
    """Bytes one rank puts on the wire for ``n`` fp32 values in ``compression`` (int8 / int4: the codec's payload,
    scales and header included)."""
    if compression is Compression.NONE:
        return 4 * n
    if compression is Compression.BF16:
        return 2 * n
    return (Int8Codec() if compression is Compression.INT8 else Int4Codec()).payload_bytes(n)


def decode_sum(codec: Codec, gathered: torch.Tensor) -> torch.Tensor:
    """Rows of ``gathered`` decoded and summed in row order, so every receiver gets bit-identical sums."""
    total = codec.decode(gathered[0])
    for row in gathered[1:]:
        total += codec.decode(row)
    return total


class ErrorFeedback:
    """Per-chunk residuals of one rank: ``encode(key, x)`` sends ``x + decay × residual[key]`` and keeps what it lost.

    ``decay`` < 1 is SparseLoCo's accumulator (arXiv:2508.15706: ``e ← β e + Δ``, send top-k of ``e``, keep the
    rest): what was not sent fades instead of waiting whole for its turn, and the accumulator then stands in for
    the outer momentum. 1 keeps the plain error feedback, under which what was sent adds up to what should have
    been, less one residual. 0 keeps each residual without adding it to the next value: for a caller that carries
    it itself (DiLoCo's ``sparse_keep_unsent`` puts it in the weights, so the next delta holds it)."""

    def __init__(self, codec: Codec, *, decay: float = 1.0) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"error-feedback decay must be in [0, 1], got {decay!r}")
        self.codec = codec
        self.decay = decay
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        corrected = x.float()
        residual = self.residuals.get(key)
        if residual is not None and self.decay:
            corrected = corrected + (residual if self.decay == 1 else residual * self.decay)
        payload = self.codec.encode(corrected)
        self.residuals[key] = corrected - self.codec.decode(payload)
        return payload

    @property
    def nbytes(self) -> int:
        """Memory held in residuals on this rank (fp32, the size of the chunks this rank sends)."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())
