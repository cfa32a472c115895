"""Reported inter-DC bytes against what the kernel counted: real gloo on this host, per-socket TCP counters.

Every rank is a process; the "datacenters" are a layout. ``ss -tinp`` gives each TCP socket's owner and
``bytes_sent`` (payload bytes, from the kernel's ``tcp_info``), so the bytes that crossed between processes
of different datacenters are counted without any formula. Each engine's count (the hierarchical engine's
``InterDCComm`` under FSDP2, the flat engine's DDP hook) must match that within 2 % (gloo's message headers, the
barriers around the window).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from wan_helpers import AABB, ABC, MB

from meridian.workers.contracts.config import Compression, OptimConfig, SyncConfig
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.sync.build import build_sync
from meridian.workers.wan.collectives import FlatHookState, flat_ddp_comm_hook

SOCKET = re.compile(r"\S+\s+\S+\s+(\S+)\s+(\S+)\s+users:\(\(.*?pid=(\d+)")
SENT = re.compile(r"bytes_sent:(\d+)")


def _ss_available() -> bool:
    """``ss -p`` names the owner of a socket of this process. (It once looked at every socket on the host: just
    after a benchmark, only sockets in TIME_WAIT, which have no owner, and the whole module skipped.)"""
    if shutil.which("ss") is None:
        return False
    with socket.socket() as own:
        own.bind(("127.0.0.1", 0))
        own.listen()
        port = own.getsockname()[1]
        out = subprocess.run(["ss", "-tlnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return f"pid={os.getpid()}" in out


pytestmark = pytest.mark.skipif(not _ss_available(), reason="needs `ss` (iproute2) with per-socket owners")


def socket_bytes(pids: set[int]) -> dict[tuple[int, int], int]:
    """Bytes sent so far from each process of ``pids`` to each other one, summed over their TCP sockets."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, timeout=30).stdout
    sockets: list[tuple[str, str, int, int]] = []  # local, peer, pid, bytes_sent
    current: list | None = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            m = SOCKET.match(line)
            current = [m.group(1), m.group(2), int(m.group(3)), 0] if m else None
            if current is not None:
                sockets.append(current)  # type: ignore[arg-type]
        elif current is not None and (s := SENT.search(line)):
            current[3] = int(s.group(1))
    owner = {local: pid for local, _, pid, _ in sockets}
    sent: dict[tuple[int, int], int] = {}
    for _local, peer, pid, nbytes in sockets:
        dst = owner.get(peer)
        if pid in pids and dst in pids and dst != pid:
            sent[pid, dst] = sent.get((pid, dst), 0) + nbytes
    return sent


def _crossing(before: dict, after: dict, dc_of_pid: dict[int, str]) -> int:
    return sum(n - before.get(k, 0) for k, n in after.items() if dc_of_pid[k[0]] != dc_of_pid[k[1]])


def _measured(layout: DCLayout, rank: int, op) -> tuple[int, float]:
    """(bytes the kernel saw cross DCs, bytes the ranks reported) for ``op()`` run on every rank."""
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    dc_of_pid = {pid: layout.dc_of(r) for r, pid in enumerate(pids)}
    dist.barrier()
    before = socket_bytes(set(pids)) if rank == 0 else {}
    dist.barrier()
    reported = torch.tensor([float(op())], dtype=torch.float64)
    dist.barrier()
    after = socket_bytes(set(pids)) if rank == 0 else {}
    dist.all_reduce(reported)
    return (_crossing(before, after, dc_of_pid) if rank == 0 else 0), float(reported.item())


class _Blocks(torch.nn.Module):
    """Four FSDP2 units of 1 MiB of fp32 gradients each (and a small root)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _har(rank: int, world: int, dcs: tuple[str, ...], compression: Compression) -> tuple[int, float]:
    layout = DCLayout(dcs)
    groups = DCGroups(layout, rank, segment_groups=False)
    torch.manual_seed(0)
    sync = SyncConfig(compression=compression, inter_dc_chunk_mb=0.25)
    engine = build_sync(_Blocks(), groups, sync, OptimConfig(warmup_steps=0))
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(rank))

    def op() -> int:
        engine.backward(engine.model(x).square().mean(), last_micro_batch=True)
        return engine.step(1e-3).inter_dc_bytes

    op()  # every pair's connection is set up before the window
    out = _measured(layout, rank, op)
    engine.close()
    groups.destroy()
    return out


def _flat(rank: int, world: int, dcs: tuple[str, ...]) -> tuple[int, float, int]:
    layout = DCLayout(dcs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 512))
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)  # several buckets
    state = FlatHookState(None, None, tuple(range(world)), dc_layout=layout)
    ddp.register_comm_hook(state, flat_ddp_comm_hook)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        ddp(x).square().mean().backward()
        return state.sent.reset().wire_bytes

    step()  # connections and DDP's bucket rebuild happen on the first backward
    kernel, reported = _measured(layout, rank, step)
    return kernel, reported, sum(p.numel() * 4 for p in model.parameters())


def _close(kernel: int, reported: float) -> bool:
    return abs(kernel - reported) <= 0.02 * kernel + 64 * 1024


@pytest.mark.parametrize(("dcs", "compression"), [(AABB.datacenters, Compression.NONE),
                                                    (ABC.datacenters, Compression.NONE),
                                                    (ABC.datacenters, Compression.INT8)])  # fmt: skip
def test_har_reports_what_crossed(dcs, compression) -> None:
    kernel, reported = run_processes(_har, len(dcs), dcs, compression, timeout_s=120)[0]
    assert kernel > MB  # the window saw the exchange
    assert _close(kernel, reported), (kernel, reported)


def test_flat_reports_what_its_ring_put_across_not_the_model_size() -> None:
    kernel, reported, param_bytes = run_processes(_flat, 4, AABB.datacenters, timeout_s=120)[0]
    assert _close(kernel, reported), (kernel, reported)
    # Two of the ring's four edges cross, each carrying 2(W-1)/W of the gradients: 3/4 of W × model size.
    assert reported == pytest.approx(2 * 1.5 * param_bytes, rel=0.01)
    assert not _close(kernel, 4 * param_bytes)  # the old figure (every rank's gradients) is not what crossed
