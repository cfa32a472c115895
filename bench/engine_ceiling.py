"""What the two-datacenter engines cost with no WAN at all, against flat sync in one datacenter. Prints JSON.

    .venv/bin/python -m meridian.bench.engine_ceiling [--model tiny] [--ranks-per-dc 2] [--steps 120] [--rounds 2]

The same ranks (local gloo processes, one torch thread each) train the same job three ways, alternating in each
round: ``flat`` with every rank in one datacenter (what a scaling efficiency divides by), ``hierarchical`` exact
and ``lookahead`` (one step late at the local look-ahead, what ``auto`` picks when the link would be exposed)
with the ranks split over two datacenters that talk over loopback. No link delays anything, so
``step_ratio_vs_flat`` (flat's step time ÷ this engine's) is the most any scaling efficiency of that engine can
reach on this machine: what is below 1 is the engine's own work (FSDP2's gathers and reduce-scatters, the sum
across datacenters, the look-ahead's second pass), not the network. On a machine whose ranks share cores that work competes with
compute.

- ``step_ms``: rank 0's mean step time over steps ``--from-step``.. (past the look-ahead's exact first steps).
- ``cpu_ms_per_step``: each rank's process CPU (every thread: training, communication, gloo's) per step over
  the same steps, read when the rank reported each step done; the mean over ranks.
- ``bucket_mb``: flat sync's DDP buckets (``--bucket-mb``; tiny's 3.5 MB in four of 1 MB); the hierarchical
  engine syncs per FSDP2 unit.
- ``final_loss``: rank 0's last training loss (flat and exact agree; the look-ahead differs slightly).

Timings are this machine's, not assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from meridian.workers.contracts.config import OptimConfig, SyncConfig, SyncStrategy, TrainConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train


class _CpuSink(ListSink):
    """Rank 0's records, and on every rank the process CPU when each step was done (from its heartbeats)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_at: dict[int, float] = {}

    def rank_step(self, beat: dict) -> None:
        if beat["phase"] == "done":
            self.cpu_at[beat["step"]] = time.process_time()


def _run(rank: int, world: int, cfg: TrainConfig, from_step: int) -> dict:
    import torch

    torch.set_num_threads(1)
    sink = _CpuSink()
    train(cfg, sink=sink)
    steady = [r.step_s for r in sink.records[from_step:]]
    return {
        "cpu_ms_per_step": 1e3 * (sink.cpu_at[cfg.steps] - sink.cpu_at[from_step]) / (cfg.steps - from_step),
        "step_ms": 1e3 * statistics.mean(steady) if steady else None,
        "final_loss": sink.records[-1].loss if sink.records else None,
    }


def configs(model: str, ranks_per_dc: int, steps: int, global_batch: int, micro_batch: int,
            bucket_mb: float) -> dict[str, TrainConfig]:  # fmt: skip
    n = 2 * ranks_per_dc

    def cfg(dcs: tuple[str, ...], **sync) -> TrainConfig:
        return TrainConfig(job_id="engine-ceiling", model=model_preset(model), steps=steps, global_batch=global_batch,
                           micro_batch=micro_batch, datacenters=dcs, sync=SyncConfig(bucket_mb=bucket_mb, **sync),
                           optim=OptimConfig(warmup_steps=5))  # fmt: skip

    two = ("dc-a",) * ranks_per_dc + ("dc-b",) * ranks_per_dc
    return {
        "flat": cfg(("dc-a",) * n, strategy=SyncStrategy.FLAT),
        "hierarchical": cfg(two, strategy=SyncStrategy.HIERARCHICAL),
        "lookahead": cfg(two, strategy=SyncStrategy.HIERARCHICAL, delay_one_step=True, local_lookahead=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--ranks-per-dc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--from-step", type=int, default=30, help="steady state from here (after the exact first steps)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="gradient buckets (flat's DDP cap too)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not 0 < args.from_step < args.steps:
        ap.error("--from-step must lie between 0 and --steps")
    runs = configs(args.model, args.ranks_per_dc, args.steps, args.global_batch, args.micro_batch, args.bucket_mb)
    rounds = []
    for _ in range(args.rounds):
        row = {}
        for name, cfg in runs.items():
            per_rank = run_processes(_run, len(cfg.datacenters), cfg, args.from_step, timeout_s=1800)
            row[name] = {
                "step_ms": round(per_rank[0]["step_ms"], 1),
                "cpu_ms_per_step": round(statistics.mean(r["cpu_ms_per_step"] for r in per_rank), 1),
                "final_loss": per_rank[0]["final_loss"],
            }
        for r in row.values():
            r["step_ratio_vs_flat"] = round(row["flat"]["step_ms"] / r["step_ms"], 3)
        rounds.append(row)
    print(json.dumps({
        "model": args.model, "ranks": 2 * args.ranks_per_dc, "steps": args.steps, "from_step": args.from_step,
        "global_batch": args.global_batch, "micro_batch": args.micro_batch, "bucket_mb": args.bucket_mb, "rounds": rounds,
        "step_ratio_vs_flat": {name: [r[name]["step_ratio_vs_flat"] for r in rounds] for name in runs},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
