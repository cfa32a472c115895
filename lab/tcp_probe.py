"""Measure a link with real TCP: round trips of one small message, then one large one-way transfer.

``serve`` answers on one connection: each 1-byte message is echoed (the round trips); then an 8-byte length
announces a bulk transfer, which is read to the end and acknowledged with one byte, so the sender's clock
stops only when the last byte has arrived. Run in two namespaces by ``meridian lab probe``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import time


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection early")
        buf += chunk
    return bytes(buf)


def serve(host: str, port: int, timeout_s: float) -> None:
    with socket.create_server((host, port)) as srv:
        srv.settimeout(timeout_s)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while _read_exactly(conn, 1) == b"p":
                conn.sendall(b"p")
            (size,) = struct.unpack("!Q", _read_exactly(conn, 8))
            left = size
            while left:
                chunk = conn.recv(min(left, 4 << 20))
                if not chunk:
                    raise ConnectionError("sender closed before the end of the transfer")
                left -= len(chunk)
            conn.sendall(b"k")


def measure(host: str, port: int, *, pings: int, bulk_bytes: int, source: str | None, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:  # the server may still be starting
        try:
            conn = socket.create_connection((host, port), timeout=timeout_s,
                                            source_address=(source, 0) if source else None)  # fmt: skip
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.settimeout(timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            conn.sendall(b"p")
            _read_exactly(conn, 1)
            rtts.append(time.perf_counter() - t0)
        conn.sendall(b"b" + struct.pack("!Q", bulk_bytes))
        payload = memoryview(bytes(4 << 20))
        t0 = time.perf_counter()
        left = bulk_bytes
        while left:
            n = conn.send(payload[: min(left, len(payload))])
            left -= n
        _read_exactly(conn, 1)
        seconds = time.perf_counter() - t0
    return {
        "rtt_ms": statistics.median(rtts) * 1e3, "rtt_min_ms": min(rtts) * 1e3, "pings": pings,
        "bulk_bytes": bulk_bytes, "bulk_s": seconds, "gbps": bulk_bytes * 8 / seconds / 1e9,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["serve", "measure"])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--source", default=None)
    p.add_argument("--pings", type=int, default=20)
    p.add_argument("--bulk-mb", type=float, default=64)
    p.add_argument("--timeout-s", type=float, default=60)
    a = p.parse_args()
    if a.role == "serve":
        serve(a.host, a.port, a.timeout_s)
    else:
        print(json.dumps(measure(a.host, a.port, pings=a.pings, bulk_bytes=int(a.bulk_mb * 2**20), source=a.source,
                                 timeout_s=a.timeout_s)))  # fmt: skip


if __name__ == "__main__":
    main()
