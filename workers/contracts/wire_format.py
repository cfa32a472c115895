"""How many bytes a compressed payload puts on the wire: one layout, read by the codecs that write it
(:mod:`meridian.workers.sync.compression`) and by the planner's link arithmetic, which runs without torch.

- int8: the values, one byte each, then one fp32 absmax scale.
- int4: the element count (int32), then the values in blocks of :data:`INT4_BLOCK`, two per byte, the last block
  zero-padded, then one fp32 absmax scale per block.
- sparse (top-k, :mod:`meridian.workers.sync.sparse_codec`): the element count (int32); two fp32 magnitudes per
  block of ``block`` elements (the least and the largest kept); the kept values' codes, ``value_bits`` each (a sign
  bit and a magnitude level), packed little-endian bit by bit and zero-padded to a byte; then their positions in
  their block, :func:`sparse_index_bits` each, packed the same way. Each block keeps :func:`sparse_kept` of its
  elements, so the size depends on the element count alone and a receive can be posted before the data exists.
"""

from __future__ import annotations

import math

INT4_BLOCK = 128
"""Elements per int4 scale: a smaller block follows the delta's local magnitude better, at 4 / BLOCK bytes
per element more on the wire."""
SCALE_BYTES = 4
"""One fp32 scale: at the end of every int8 payload, after every int4 block."""
INT4_HEADER_BYTES = 4
"""int4: the element count (int32) leads the payload, so a payload decodes on its own."""


def int8_payload_bytes(n: int) -> int:
    return n + SCALE_BYTES


def int4_payload_bytes(n: int, block: int = INT4_BLOCK) -> int:
    blocks = -(-n // block)
    return INT4_HEADER_BYTES + blocks * block // 2 + blocks * SCALE_BYTES


def int4_bytes_per_element(block: int = INT4_BLOCK) -> float:
    """What an int4 payload costs per element, leaving out its header and the last block's padding."""
    return 0.5 + SCALE_BYTES / block


SPARSE_HEADER_BYTES = 4
"""sparse: the element count (int32) leads the payload, as int4's does."""
SPARSE_SCALES_PER_BLOCK = 2
"""sparse: the least and the largest magnitude kept in a block (fp32 each)."""


def sparse_kept(n: int, density: float) -> int:
    """Elements a sparse block of ``n`` keeps: ``ceil(density × n)``, at least one, at most ``n`` (none of none).
    The product is rounded to 9 decimals first, so 0.01 × 100 keeps 1, not the 2 its float error would ask."""
    if n <= 0:
        return 0
    return min(n, max(1, math.ceil(round(density * n, 9))))


def sparse_index_bits(block: int) -> int:
    """Bits of one kept element's position in its block (0 … block − 1)."""
    return max(1, (block - 1).bit_length())


def sparse_payload_bytes(n: int, density: float, value_bits: int, block: int) -> int:
    """Bytes of the sparse payload of ``n`` fp32 values: header, block scales, value codes, positions."""
    full, rest = divmod(n, block)
    blocks = full + (rest > 0)
    kept = full * sparse_kept(block, density) + sparse_kept(rest, density)
    return (SPARSE_HEADER_BYTES + blocks * SPARSE_SCALES_PER_BLOCK * SCALE_BYTES + -(-kept * value_bits // 8)
            + -(-kept * sparse_index_bits(block) // 8))


def sparse_bytes_per_element(density: float, value_bits: int, block: int) -> float:
    """What a sparse payload costs per element over whole blocks, leaving out its header and byte padding."""
    kept = sparse_kept(block, density)
    return (SPARSE_SCALES_PER_BLOCK * SCALE_BYTES + kept * (value_bits + sparse_index_bits(block)) / 8) / block
