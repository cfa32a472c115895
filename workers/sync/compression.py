"""Wire encodings for the inter-DC step, and the error feedback that keeps them unbiased over time.

- :class:`Bf16Codec`: round to bfloat16 (2 bytes per element). bf16 values can be summed on the wire.
- :class:`Int8Codec`: one absmax scale per chunk, ``q = round(x / scale)`` in [-127, 127], 1 byte per
  element plus a 4-byte fp32 scale. int8 values cannot be summed on the wire (they overflow, and every
  sender has its own scale), so the receivers all-gather the payloads and sum after decoding.
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

INT8_LEVELS = 127
_SCALE_BYTES = 4  # one fp32 scale rides at the end of every int8 payload


class Codec(Protocol):
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 values (n,) → the payload that goes on the wire."""
        ...

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """One payload → fp32 values (n,)."""
        ...


class Bf16Codec:
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.float()


class Int8Codec:
    """``[q_0 … q_{n-1} | scale]`` as n + 4 bytes (uint8 on the wire: every backend carries bytes)."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        absmax = x.abs().max() if x.numel() else x.new_zeros(())
        scale = torch.where(absmax > 0, absmax / INT8_LEVELS, torch.ones_like(absmax)).reshape(1)
        q = torch.round(x / scale).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)])

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        q = payload[:-_SCALE_BYTES].view(torch.int8)
        scale = payload[-_SCALE_BYTES:].clone().view(torch.float32)
        return q.float() * scale

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        """(k, n + 4) payloads of the k datacenters → their fp32 sum, added in row order on every rank."""
        total = self.decode(gathered[0])
        for row in gathered[1:]:
            total += self.decode(row)
        return total


class ErrorFeedback:
    """Per-chunk residuals of one rank: ``encode(key, x)`` sends ``x + residual[key]`` and keeps what it lost."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        corrected = x.float()
        residual = self.residuals.get(key)
        if residual is not None:
            corrected = corrected + residual
        payload = self.codec.encode(corrected)
        self.residuals[key] = corrected - self.codec.decode(payload)
        return payload

    @property
    def nbytes(self) -> int:
        """Memory held in residuals on this rank (fp32, the size of the chunks this rank sends)."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())
