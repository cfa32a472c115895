"""``meridian bench scaling``: what splitting the same workers over datacenters costs.

``scaling_efficiency`` = throughput (tokens/s) with the workers split over ``--dcs`` datacenters behind the
emulated WAN ÷ throughput of the same workers in one datacenter with no WAN. It is reported for
``hierarchical+overlap`` (Meridian's engine) and for ``flat`` (DDP, the Ray Train default), each against
its own single-DC run and against the fastest single-DC run. Throughput comes from the median step time on
rank 0 (steps after the warm-up of every round); the two layouts run in alternating rounds, so slow drift
in the machine's load falls on both.
"""

from __future__ import annotations

import argparse
import statistics

from meridian.bench.sync import (
    WARMUP_STEPS,
    add_common_arguments,
    check_args,
    job_config,
    layout,
    measure_link,
    run_strategies,
)
from meridian.workers.contracts.config import SyncConfig, SyncStrategy, WanConfig

NAME = "scaling"
HELP = "throughput of the same workers across datacenters (emulated WAN) vs in one datacenter"


def _strategies(args: argparse.Namespace) -> dict[str, SyncConfig]:
    return {
        "hierarchical+overlap": SyncConfig(overlap=True, bucket_mb=args.bucket_mb, inter_dc_chunk_mb=args.chunk_mb),
        "flat": SyncConfig(strategy=SyncStrategy.FLAT, bucket_mb=args.bucket_mb),
    }


def run(args: argparse.Namespace) -> dict:
    args.no_wan = False
    check_args(args)
    wan = WanConfig(rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps)
    named = _strategies(args)
    rounds, args.rounds = args.rounds, 1
    step_s: dict[str, dict[str, list[float]]] = {n: {"one_dc": [], "multi_dc": []} for n in named}
    for _ in range(rounds):
        for where, dcs, link in (
            ("one_dc", layout(args, one_dc=True), None),
            ("multi_dc", layout(args, one_dc=False), wan),
        ):
            rank0 = run_strategies(args, named, dcs, link)[0]
            for n in named:
                step_s[n][where] += rank0[n]["step_s"]
    tokens_per_step = job_config(args, named["flat"], layout(args, one_dc=True), None).tokens_per_step
    tput = {
        n: {where: tokens_per_step / statistics.median(xs) for where, xs in d.items()} for n, d in step_s.items()
    }
    best_one_dc = max(t["one_dc"] for t in tput.values())
    report = {
        n: {
            "tokens_per_s_one_dc": round(t["one_dc"], 1),
            "tokens_per_s_multi_dc": round(t["multi_dc"], 1),
            "step_ms_one_dc": round(1000 * statistics.median(step_s[n]["one_dc"]), 2),
            "step_ms_multi_dc": round(1000 * statistics.median(step_s[n]["multi_dc"]), 2),
            "scaling_efficiency": round(t["multi_dc"] / t["one_dc"], 4),
            "scaling_efficiency_vs_best_one_dc": round(t["multi_dc"] / best_one_dc, 4),
        }
        for n, t in tput.items()
    }
    return {
        "model": args.model,
        "workers": args.dcs * args.workers_per_dc,
        "datacenters": args.dcs,
        "steps": args.steps,
        "rounds": rounds,
        "timed_steps_per_layout": (args.steps - WARMUP_STEPS) * rounds,
        "wan": {"rtt_ms": wan.rtt_ms, "gbps": wan.gbps},
        "emulation": measure_link(wan),
        "best": "hierarchical+overlap",
        "strategies": report,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)


def render(result: dict) -> str:
    em = result["emulation"]
    rows = [
        f"{result['model']}, {result['workers']} workers: {result['datacenters']} DCs behind "
        f"{result['wan']['rtt_ms']} ms / {result['wan']['gbps']} Gbit/s (measured {em['rtt_ms_measured']} ms / "
        f"{em['gbps_measured']} Gbit/s) vs one DC",
        f"{'strategy':<24}{'tok/s 1 DC':>12}{'tok/s multi':>13}{'efficiency':>12}{'vs best 1 DC':>14}",
    ]
    for n, s in result["strategies"].items():
        rows.append(
            f"{n:<24}{s['tokens_per_s_one_dc']:>12.1f}{s['tokens_per_s_multi_dc']:>13.1f}"
            f"{s['scaling_efficiency']:>12.3f}{s['scaling_efficiency_vs_best_one_dc']:>14.3f}"
        )
    return "\n".join(rows)
