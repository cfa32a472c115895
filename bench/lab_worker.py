"""One rank of a ``meridian bench lab`` job: train, and note per step what the kernel counted on the link.

Run as ``python -m meridian.bench.lab_worker SPEC.json`` inside a datacenter's network namespace (the lab's
workers) or called as :func:`run_rank` by :func:`meridian.workers.distributed.multiproc.run_processes` (the
emulated and local runs). A rank whose spec names a ``link_device`` reads that device's ``tx_bytes`` after
every step: inside its namespace ``/sys/class/net`` shows the namespace's devices, so the datacenter's
first rank reads its own end of the inter-DC link.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.records import StepRecord
from meridian.workers.loop.train import train

RANK_TIMEOUT_S = 600.0


def tx_bytes(device: str) -> int:
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


@dataclass
class LabSink:
    """Rank 0's step records; on every rank its own steps' times (the loop's per-step heartbeats) and, with
    ``link_device``, the link's sent bytes after each step."""

    link_device: str | None = None
    count_at: frozenset[int] | None = None
    """The steps after which to read the link's counter (``None``: every step). Each read costs the loop ~50 µs,
    a share of a short step that the bench would otherwise count against the job."""
    records: list[StepRecord] = field(default_factory=list)
    beats: list[dict[str, Any]] = field(default_factory=list)
    """This rank's heartbeat after each of its steps: ``step_s``, ``sync_wait_s`` and the ``time`` it ended."""
    counters: dict[int, int] = field(default_factory=dict)
    """Step (1-based, steps done) → the link device's ``tx_bytes`` right after this rank finished it."""
    cpu_s: list[float] = field(default_factory=list)
    """This process's CPU time (all its threads: the loop, the sync's communication thread, gloo's) when each
    of its steps ended."""
    system_cpu_s: list[float] = field(default_factory=list)
    """Of it, the time spent in the kernel (system calls: the sockets' sends and receives, copies)."""

    def step(self, record: StepRecord) -> None:
        self.records.append(record)

    def rank_step(self, beat: dict[str, Any]) -> None:
        if beat.get("phase") != "done":
            return
        self.beats.append(beat)
        t = os.times()
        self.cpu_s.append(t.user + t.system)
        self.system_cpu_s.append(t.system)
        step = int(beat["step"])
        if self.link_device is not None and (self.count_at is None or step in self.count_at):
            self.counters[step] = tx_bytes(self.link_device)


def run_rank(rank: int, world: int, cfg: TrainConfig, link_device: str | None = None,
             count_at: frozenset[int] | None = None) -> dict[str, Any]:  # fmt: skip
    """Train ``cfg`` on this rank (the default process group is up); what the bench needs of it."""
    torch.set_num_threads(1)  # every rank of the job shares this machine's cores
    sink = LabSink(link_device, count_at)
    train(cfg, sink=sink)
    recs, beats = sink.records, sink.beats
    return {
        "rank": rank,
        # this rank's own steps: the loop's wall from the first step's start to the last one's end (evaluation
        # excluded), each step's time and what it waited for its sync
        "loop_wall_s": beats[-1]["time"] - beats[0]["time"] + beats[0]["step_s"] if beats else 0.0,
        "step_s": [b["step_s"] for b in beats],
        "sync_wait_s": [b["sync_wait_s"] for b in beats],
        "cpu_s": sink.cpu_s,
        "system_cpu_s": sink.system_cpu_s,
        # what rank 0 reports for the job (empty on the other ranks)
        "val_loss": next((r.val_loss for r in reversed(recs) if r.val_loss is not None), None),
        "inter_dc_bytes": [r.inter_dc_bytes for r in recs],
        "loss": [r.loss for r in recs],
        "counters": sink.counters,
    }


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    cfg = pickle.loads(Path(spec["config"]).read_bytes())
    dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}", rank=spec["rank"],
                            world_size=spec["world"], timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))  # fmt: skip
    try:
        count_at = spec.get("count_at")
        out = run_rank(spec["rank"], spec["world"], cfg, spec.get("link_device"),
                       None if count_at is None else frozenset(count_at))  # fmt: skip
        dist.barrier()  # no rank tears down (rank 0 hosts the store) while a peer still talks to it
    finally:
        dist.destroy_process_group()
    out["finished_at"] = time.time()
    tmp = spec["output"] + ".tmp"
    Path(tmp).write_text(json.dumps(out))
    os.replace(tmp, spec["output"])
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk. Skip the interpreter's teardown: once, under the full test suite's load, a rank
    # aborted there ("terminate called without an active exception", a C++ thread destroyed while joinable).
    os._exit(code)
