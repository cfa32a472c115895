"""How many bytes a compressed payload puts on the wire: one layout, read by the codecs that write it
(:mod:`meridian.workers.sync.compression`) and by the planner's link arithmetic, which runs without torch.

- int8: the values, one byte each, then one fp32 absmax scale.
- int4: the element count (int32), then the values in blocks of :data:`INT4_BLOCK`, two per byte, the last block
  zero-padded, then one fp32 absmax scale per block.
"""

from __future__ import annotations

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
