"""Measure an emulated inter-DC link the way one would measure a real one: ping-pong for the RTT, a large
one-way transfer for the bandwidth.

What it is for: checking that the emulator delivers the ``WanConfig`` it was given (the tests hold it to
10 %), and printing what a job's ranks actually see. What it must never do: read the configuration to
produce a "measurement" — every number comes from timed point-to-point messages.
"""

from __future__ import annotations

import statistics
import time
import uuid

import torch
import torch.distributed as dist

from meridian.workers.contracts.config import WanConfig
from meridian.workers.distributed.layout import DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.wan.collectives import WanEmulator, cleanup, recv, send


def probe_link(
    emulator: WanEmulator,
    peer: int,
    *,
    pings: int = 5,
    bulk_bytes: int = 16 << 20,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Measure the link between this rank and world rank ``peer`` (both call it; they must be in different
    DCs). The lower rank drives the measurement and sends the results to the other; both return
    ``{"rtt_ms_measured", "gbps_measured", "rtt_ms_configured", "gbps_configured"}``."""
    me = emulator.rank
    if emulator.layout.dc_of(me) == emulator.layout.dc_of(peer):
        raise ValueError(f"ranks {me} and {peer} are both in {emulator.layout.dc_of(me)}: nothing to probe")
    if emulator.wan is None:
        raise ValueError("probe_link needs an emulator with a WanConfig")
    tiny, ack = torch.zeros(1), torch.zeros(1)
    bulk = torch.zeros(bulk_bytes // 4)
    driver = me < peer

    def ping() -> None:
        if driver:
            send(tiny, peer, group, emulator=emulator)
            recv(tiny, peer, group, emulator=emulator)
        else:
            recv(tiny, peer, group, emulator=emulator)
            send(tiny, peer, group, emulator=emulator)

    ping()  # the first message of a pair sets up gloo's connection: not part of the link
    rtts = []
    for _ in range(pings):
        t0 = time.monotonic()
        ping()
        rtts.append(time.monotonic() - t0)
    rtt = statistics.median(rtts)

    # Bandwidth: the time from starting a large send to receiving the peer's tiny acknowledgement is
    # bytes / bandwidth plus one round trip, which the pings just measured.
    t0 = time.monotonic()
    if driver:
        send(bulk, peer, group, emulator=emulator)
        recv(ack, peer, group, emulator=emulator)
    else:
        recv(bulk, peer, group, emulator=emulator)
        send(ack, peer, group, emulator=emulator)
    elapsed = time.monotonic() - t0

    # The results travel outside the emulator: they are not part of the measurement.
    result = torch.tensor([rtt * 1e3, bulk_bytes * 8 / max(elapsed - rtt, 1e-9) / 1e9], dtype=torch.float64)
    if driver:
        dist.send(result, peer, group)
    else:
        dist.recv(result, peer, group)
    return {
        "rtt_ms_measured": float(result[0]),
        "gbps_measured": float(result[1]),
        "rtt_ms_configured": emulator.wan.rtt_ms,
        "gbps_configured": emulator.wan.gbps,
    }


def _probe_rank(rank: int, world_size: int, wan: WanConfig, key: str, pings: int, bulk_bytes: int) -> dict:
    emulator = WanEmulator(wan, DCLayout(("dc-a", "dc-b")), rank, key=key)
    try:
        return probe_link(emulator, 1 - rank, pings=pings, bulk_bytes=bulk_bytes)
    finally:
        emulator.close()


def probe(
    wan: WanConfig, *, pings: int = 5, bulk_bytes: int = 16 << 20, timeout_s: float = 120.0
) -> dict[str, float]:
    """Start two gloo processes, one per DC, behind an emulated ``wan`` link and probe it (see
    :func:`probe_link`)."""
    key = f"probe.{uuid.uuid4().hex[:12]}"
    try:
        return run_processes(_probe_rank, 2, wan, key, pings, bulk_bytes, timeout_s=timeout_s)[0]
    finally:
        cleanup(key)


if __name__ == "__main__":
    import json
    import sys

    rtt_ms, gbps = (float(x) for x in sys.argv[1:3]) if len(sys.argv) > 2 else (21.0, 1.0)
    print(json.dumps(probe(WanConfig(rtt_ms=rtt_ms, gbps=gbps))))
