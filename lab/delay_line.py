"""The inter-datacenter link: a process that holds every packet between datacenters for the one-way delay.

The kernel here has no ``netem``, so the delay is done in user space: each datacenter namespace has a TUN
device routed to the other datacenters' subnets; this process reads a packet from one TUN, keeps it for the
one-way delay and writes it to the TUN of the datacenter that owns its destination address. The delay is
constant, so packets leave in the order they came (one FIFO for all directions). The rate is not set here:
the kernel's ``tbf`` on each TUN limits what a datacenter sends, and a full queue drops, as a router does.

The TUNs take segmentation offload (``IFF_VNET_HDR`` + ``TUNSETOFFLOAD``), as a real NIC does: TCP hands the
line segments of up to 64 KiB, each carried whole and handed to the receiving stack as one, so the line's
per-packet work (a Python loop and two system calls each) is done several times less often. The line runs on
the same cores as the ranks, and a real WAN costs them no CPU: what it spends is the lab's distortion. The rate
and the delay do not change; the kernel's byte counters count a large segment's headers once instead of once
per wire-sized packet (40 bytes in 9,000 less each).

``delay_line.c`` is the same line in C, for a small part of the CPU: ``meridian lab`` builds it with the
machine's C compiler (:func:`build_native`) and runs it when it can, and this module when it cannot (no compiler)
or is told to (``--delay-line python``). Either must never touch a namespace or device the lab did not create.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUNSETOFFLOAD = 0x400454D0
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HDR_BYTES = 10
"""``struct virtio_net_hdr`` before every packet read or written with ``IFF_VNET_HDR``: the segmentation and
checksum state the line passes on untouched."""
READ_BYTES = 2**16 + VNET_HDR_BYTES
CLONE_NEWNET = 0x40000000
MAX_QUEUED_BYTES = 256 * 2**20
"""At 1 Gbit/s and 100 ms one way, 12.5 MB are in flight; beyond this much the line drops, as a router's
buffer would."""


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path) as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")


def open_tun(netns: str, device: str, offload: bool = True) -> int:
    """Attach to the persistent TUN ``device`` inside namespace ``netns``; the fd keeps working after this
    process returns to its own namespace. With ``offload`` the device takes checksum and TCP segmentation
    offload, and every packet comes and goes with a ``virtio_net_hdr`` in front."""
    own = f"/proc/{os.getpid()}/ns/net"
    home = os.open(own, os.O_RDONLY)
    try:
        _setns(f"/run/netns/{netns}")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", device.encode(), flags))
        # the device keeps the offloads an earlier line set: without the header it must not be handed segments
        fcntl.ioctl(fd, TUNSETOFFLOAD, (TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) if offload else 0)
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
    return fd


def destination_index(packet: bytes, at: int = 0) -> int | None:
    """The datacenter index of the destination 198.18.(i+1).x of the IPv4 packet starting at byte ``at``, else
    ``None``."""
    if (len(packet) < at + 20 or packet[at] >> 4 != 4 or packet[at + 16] != 198 or packet[at + 17] != 18
            or packet[at + 18] == 0):
        return None
    return packet[at + 18] - 1


def run(tuns: list[tuple[str, str]], one_way_s: float, stop: list[bool], offload: bool = True) -> dict[str, int]:
    """Forward packets between the TUNs (index ``i`` = datacenter ``i``) until ``stop[0]``."""
    fds = [open_tun(ns, dev, offload) for ns, dev in tuns]
    at = VNET_HDR_BYTES if offload else 0
    index_of = {fd: i for i, fd in enumerate(fds)}
    queue: deque[tuple[float, int, bytes]] = deque()
    queued = forwarded = dropped = 0
    while not stop[0]:
        now = time.monotonic()
        timeout = max(0.0, queue[0][0] - now) if queue else 0.2
        try:
            readable, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in readable:
            for _ in range(256):  # drain what arrived, but let due packets out in between
                try:
                    packet = os.read(fd, READ_BYTES)
                except BlockingIOError:
                    break
                dst = destination_index(packet, at)
                if dst is None or dst >= len(fds) or dst == index_of[fd] or queued > MAX_QUEUED_BYTES:
                    dropped += 1
                    continue
                queue.append((now + one_way_s, dst, packet))
                queued += len(packet)
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, dst, packet = queue.popleft()
            queued -= len(packet)
            try:
                os.write(fds[dst], packet)
                forwarded += 1
            except OSError as e:  # the receiving namespace is going away, or its queue is full
                if e.errno not in (errno.EAGAIN, errno.EIO, errno.EBADFD):
                    raise
                dropped += 1
    for fd in fds:
        os.close(fd)
    return {"forwarded": forwarded, "dropped": dropped}


NATIVE_SOURCE = Path(__file__).with_name("delay_line.c")
KINDS = ("auto", "native", "python")
"""``native``: the C line, or an error saying why it cannot be built; ``python``: this module; ``auto``: the C
line where the machine has a C compiler, else this module."""
KINDS_HELP = ("what carries the inter-DC link: native (a C program built with the machine's compiler: the least "
              "of the ranks' CPU), python, or auto (native where a C compiler is found; the default)")


class NativeLineUnavailable(RuntimeError):
    """The C line cannot be built here, in words a person can act on."""


def c_compiler() -> str | None:
    """The compiler that builds the C line: ``$CC``, else ``cc`` or ``gcc`` on PATH; ``None`` without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_native(cache_dir: Path) -> Path:
    """The C line compiled for this machine, built once per source text into ``cache_dir``."""
    source = NATIVE_SOURCE.read_bytes()
    binary = cache_dir / f"delay-line-{hashlib.sha256(source).hexdigest()[:16]}"
    if binary.exists():
        return binary
    compiler = c_compiler()
    if not compiler:
        raise NativeLineUnavailable("no C compiler (cc or gcc) on PATH to build the lab's delay line; install one, "
                                    "or run `meridian lab up --delay-line python` (more of the ranks' CPU)")  # fmt: skip
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.partial")
    try:
        out = subprocess.run([compiler, "-O2", "-Wall", "-Werror", "-o", str(partial), str(NATIVE_SOURCE)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeLineUnavailable(f"the C compiler {compiler!r} could not run ({e}) to build the lab's delay "
                                    "line; set CC to one that does, or use --delay-line python") from None  # fmt: skip
    if out.returncode != 0:
        partial.unlink(missing_ok=True)
        raise NativeLineUnavailable(f"{compiler} could not build {NATIVE_SOURCE.name}: "
                                    + " | ".join(out.stderr.strip().splitlines()[-5:]))  # fmt: skip
    partial.replace(binary)  # whole or not at all, for two labs building at once
    return binary


def command(tuns: list[tuple[str, str]], one_way_ms: float, kind: str, cache_dir: Path,
            offload: bool = True) -> tuple[list[str], str, str]:
    """The command that runs the line, the kind it is (``native`` or ``python``) and, when ``auto`` fell back to
    Python, why."""
    if kind not in KINDS:
        raise ValueError(f"delay line {kind!r}: choose one of {', '.join(KINDS)}")
    why = ""
    if kind != "python":
        try:
            binary = build_native(cache_dir)
            pairs = [part for ns, dev in tuns for part in (ns, dev)]
            return [str(binary), f"{one_way_ms * 1000:.3f}", str(int(offload)), *pairs], "native", ""
        except NativeLineUnavailable as e:
            if kind == "native":
                raise
            why = str(e)
    cmd = [sys.executable, "-m", "meridian.lab.delay_line", "--tuns", json.dumps(tuns),
           "--one-way-ms", str(one_way_ms)] + ([] if offload else ["--no-offload"])  # fmt: skip
    return cmd, "python", why


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tuns", required=True, help='JSON list of [netns, device], in datacenter order')
    p.add_argument("--one-way-ms", type=float, required=True)
    p.add_argument("--no-offload", action="store_true", help="wire-sized packets, each through the line")
    args = p.parse_args()
    stop = [False]

    def _stop(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    counts = run([tuple(t) for t in json.loads(args.tuns)], args.one_way_ms / 1000, stop, not args.no_offload)
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
