"""``meridian bench checkpoint``: what a sharded (DCP) checkpoint costs the training step, on local gloo ranks.

    meridian bench checkpoint --json [--model llama-tiny] [--layout a,a,b,b] [--steps 24] [--every 4]

Runs the elastic trainer (the loop every job runs) twice in the same layout: without checkpoints, then with a
checkpoint every ``--every`` steps (each rank writes its shard on a background thread; the final save is
waited for, as a job does). Reports, per run, the wall-clock interval between consecutive steps (rank 0's
step records; the first two steps, warm-up, are left out) split into steps right after a save and the rest,
the whole run's wall time, and the checkpoint's size and files. Then it resumes the last checkpoint in the
same layout in fresh processes, twice: each rank reading the weights and only the optimizer state it holds
(what a job does), and each reading everything; per rank, the bytes read, the seconds, and the growth of its
peak RSS. Timings are this machine's, not assertions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

NAME = "checkpoint"
HELP = "step-time cost of sharded (DCP) checkpoints vs none, on local gloo ranks"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny", help="model preset (default llama-tiny)")
    p.add_argument("--layout", default="a,a,b,b", help="datacenter of each rank (default a,a,b,b)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    p.add_argument("--seq-len", type=int, default=64)


class _Formed:
    """One epoch over the group :func:`run_processes` formed (no coordinator)."""

    def __init__(self, rank: int, world: int, cfg: Any) -> None:
        from meridian.workers.contracts.rendezvous import Assignment

        self.a = Assignment.of(epoch=1, rank=rank, world_size=world, datacenters=cfg.datacenters, master_addr="",
                            master_port=0, resume_step=0, from_checkpoint=False, newcomer_ranks=tuple(range(world)))

    def join(self, *, last_step: int, timeout_s: float) -> Any:
        return self.a

    def form(self, a: Any) -> None:
        pass

    def finish(self) -> None:
        pass


def _run(rank: int, world: int, cfg: Any) -> dict[str, Any] | None:
    from meridian.workers.elastic.trainer import ElasticTrainer
    from meridian.workers.loop.train import ListSink

    sink = ListSink()
    t0 = time.perf_counter()
    trainer = ElasticTrainer(cfg, _Formed(rank, world, cfg), sink=sink, on_event=lambda *e: None)
    trainer.run()
    wall = time.perf_counter() - t0
    if rank != 0:
        return None
    return {"times": [r.time for r in sink.records], "wall_s": wall, "call_s": trainer.checkpoints.call_s,
            "write_s": trainer.checkpoints.write_s}


def _resume(rank: int, world: int, cfg: Any, own_ranges_only: bool) -> dict[str, Any]:
    """Load the run's last checkpoint into a fresh engine of the same layout: each rank reading only what it
    holds (what a job does), or everything (the full-state path an engine without ranges takes)."""
    import resource

    from meridian.workers.distributed.layout import DCGroups, DCLayout
    from meridian.workers.elastic.durable import load_weights, restore_latest
    from meridian.workers.elastic.trainer import fingerprint
    from meridian.workers.model.build import build_model
    from meridian.workers.state.sharded_checkpoint import load_full, open_checkpoint, stored_nbytes
    from meridian.workers.sync.build import build_sync

    engine = build_sync(build_model(cfg.model), DCGroups(DCLayout(cfg.datacenters), rank), cfg.sync, cfg.optim)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if own_ranges_only:
        done = restore_latest(cfg.checkpoint_dir, fingerprint(cfg), engine.model, engine)
        assert done is not None
        read = done.bytes_read
    else:
        ck = open_checkpoint(str(Path(cfg.checkpoint_dir) / (Path(cfg.checkpoint_dir) / "latest").read_text()))
        params, optimizer = load_full(ck)
        load_weights(engine.model, engine, params)
        engine.load_optimizer_state(optimizer)
        read = stored_nbytes(ck)
    seconds = time.perf_counter() - t0
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    engine.close()
    return {"bytes_read": read, "seconds": seconds, "peak_rss_growth_mb": rss_growth / 1024}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from meridian.workers.contracts.config import OptimConfig, SyncConfig, TrainConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.distributed.multiproc import run_processes

    dcs = tuple(args.layout.split(","))
    cfg = TrainConfig(job_id=f"bench-ckpt-{os.getpid()}", model=replace(model_preset(args.model), seq_len=args.seq_len),
                      steps=args.steps, global_batch=2 * len(dcs), micro_batch=2, datacenters=dcs,
                      optim=OptimConfig(warmup_steps=1), sync=SyncConfig())
    out: dict[str, Any] = {"model": args.model, "params": cfg.model.num_params, "layout": list(dcs),
                           "steps": args.steps, "every": args.every, "load_avg": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="meridian-bench-ckpt-") as tmp:
        for name, c in (("none", cfg), ("dcp", replace(cfg, checkpoint_dir=tmp, checkpoint_every=args.every))):
            got = run_processes(_run, len(dcs), c, timeout_s=600)[0]
            assert got is not None
            # gaps[i]: from step i + 1's record to step i + 2's; a save after step s lands in gaps[s - 1].
            # gaps[0] (warm-up) is left out.
            gaps = [b - a for a, b in zip(got["times"], got["times"][1:], strict=False)]
            after_save = [g for i, g in enumerate(gaps) if i > 0 and (i + 1) % args.every == 0]
            others = [g for i, g in enumerate(gaps) if i > 0 and (i + 1) % args.every != 0]
            out[name] = {"wall_s": round(got["wall_s"], 3), "step_median_s": round(statistics.median(others), 4),
                         "after_save_median_s": round(statistics.median(after_save), 4) if after_save else None,
                         "saves": len(after_save)}  # fmt: skip
            if got["call_s"]:  # the first save also forms the checkpoint group: reported apart
                out[name]["training_thread_ms"] = {"first": round(got["call_s"][0] * 1e3, 2),
                                                   "median_rest": round(statistics.median(got["call_s"][1:]) * 1e3, 3)}
                out[name]["writer_median_ms"] = round(statistics.median(got["write_s"]) * 1e3, 1)
        # Resuming that checkpoint in the same layout, both ways, each in fresh processes.
        resumed = replace(cfg, checkpoint_dir=tmp)
        out["resume"] = {}
        for name, own in (("own_ranges", True), ("full_state", False)):
            per_rank = run_processes(_resume, len(dcs), resumed, own, timeout_s=600)
            out["resume"][name] = {
                "mb_read_per_rank": [round(r["bytes_read"] / 2**20, 3) for r in per_rank],
                "seconds_max": round(max(r["seconds"] for r in per_rank), 3),
                "peak_rss_growth_mb_per_rank": [round(r["peak_rss_growth_mb"], 1) for r in per_rank]}
        final = Path(tmp) / f"step-{args.steps:08d}"
        files = sorted(final.iterdir()) if final.is_dir() else []
        out["checkpoint"] = {"files": [f.name for f in files], "bytes": sum(f.stat().st_size for f in files)}
    none, dcp_ = out["none"], out["dcp"]
    out["ratios"] = {
        "step_after_save_vs_none": round(dcp_["after_save_median_s"] / none["step_median_s"], 3)
        if dcp_["after_save_median_s"] else None,
        "other_steps_vs_none": round(dcp_["step_median_s"] / none["step_median_s"], 3),
        "wall_vs_none": round(dcp_["wall_s"] / none["wall_s"], 3),
        "resume_bytes_own_vs_full": round(sum(out["resume"]["own_ranges"]["mb_read_per_rank"])
                                          / sum(out["resume"]["full_state"]["mb_read_per_rank"]), 3),
    }
    return out


def render(r: dict[str, Any]) -> str:
    return (f"{r['model']} on {','.join(r['layout'])}, checkpoint every {r['every']} of {r['steps']} steps "
            f"(load {r['load_avg']:.1f}):\n"
            f"  no checkpoints : step {r['none']['step_median_s'] * 1e3:.1f} ms, run {r['none']['wall_s']:.1f} s\n"
            f"  DCP, per rank  : step {r['dcp']['step_median_s'] * 1e3:.1f} ms, step after a save "
            f"{(r['dcp']['after_save_median_s'] or 0) * 1e3:.1f} ms, run {r['dcp']['wall_s']:.1f} s\n"
            f"  per save       : training thread {r['dcp'].get('training_thread_ms')} ms, writer "
            f"{r['dcp'].get('writer_median_ms')} ms\n"
            f"  resume         : {r['resume']}\n"
            f"  ratios         : {r['ratios']}\n  checkpoint     : {r['checkpoint']['bytes']} bytes, "
            f"{len(r['checkpoint']['files'])} files")
