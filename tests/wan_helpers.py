"""Shared figures of the WAN emulator tests."""

from __future__ import annotations

import uuid

from meridian.workers.contracts.config import WanConfig
from meridian.workers.distributed.layout import DCLayout

MB = 1 << 20
AB = DCLayout(("dc-a", "dc-b"))
AABB = DCLayout(("dc-a", "dc-a", "dc-b", "dc-b"))
ABAB = DCLayout(("dc-a", "dc-b", "dc-a", "dc-b"))
AAB = DCLayout(("dc-a", "dc-a", "dc-b"))
ABC = DCLayout(("dc-a", "dc-b", "dc-c"))
WAN = WanConfig(rtt_ms=20.0, gbps=1.0)  # 10 ms one way, 125 MB/s


def late(model_s: float) -> float:
    """Upper bound for a measured time whose model is ``model_s``: scheduling on a busy 2-core host."""
    return 1.25 * model_s + 0.06


def new_key() -> str:
    return f"test.{uuid.uuid4().hex[:12]}"
