"""``meridian bench sync``: every sync strategy trained for real on local gloo processes, in one run.

For each strategy the same job (model, data order, seed) runs ``--steps`` optimizer steps on
``--dcs × --workers-per-dc`` processes, the inter-DC link emulated by :mod:`meridian.workers.wan.collectives`
(``--rtt-ms``, ``--inter-dc-gbps``; ``--no-wan`` puts every rank in one DC with no emulation: the
single-DC baseline). Reported per strategy, all measured:

- ``step_ms``: median wall time of a step on rank 0, steps after the first two (warm-up) of every round;
  ``step_ms_mean`` their mean, which is what counts for DiLoCo (its median step has no outer sync at all);
- ``inter_dc_bytes_per_step``: tensor bytes put into collectives crossing a DC boundary, summed over ranks;
- ``inter_dc_bytes_theoretical``: the HAR minimum for the model and topology — every rank sends its 1/N
  shard once, i.e. ``dcs × params × bytes per element`` of the strategy's wire format (fp32 4, bf16 2, int8 1)
- ``max_abs_diff_vs_flat``: largest parameter difference from ``flat`` after the last step;
- ``optimizer_state_bytes_per_rank``: AdamW state held per rank (max over ranks);
- ``overlap_fraction``: share of the gradient sync hidden behind backward (mean over timed steps).
- ``loss_last5`` / ``eval_loss``: quality at the same number of tokens (every strategy trains the same steps
  on the same samples of the real text corpus): mean global training loss of the last 5 steps, and the
  held-out loss of rank 0's parameters after the last step (for DiLoCo: its DC's replica).

``diloco`` and ``streaming-diloco`` (:mod:`meridian.workers.sync.diloco`, H = ``--diloco-h``) sync across DCs only
every H steps (per fragment), so their ``inter_dc_bytes_theoretical`` is the HAR minimum divided by H, and
their ``max_abs_diff_vs_flat`` measures how far training drifted from exact data parallelism, not an error.
``quality`` puts every strategy's losses next to per-step ``hierarchical+overlap``'s.

``emulation`` is what a ping-pong/bulk probe measured on the emulated link (not the configuration).
Rounds (``--rounds``) run the strategies interleaved, so drift in machine load hits all of them alike.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass

import torch

from meridian.workers.contracts.config import (
    Compression,
    DiLoCoConfig,
    FsdpUnits,
    OptimConfig,
    ParallelConfig,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
    WanConfig,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train

NAME = "sync"
HELP = "train every sync strategy on local gloo processes behind an emulated WAN; step time, bytes, overlap"

WARMUP_STEPS = 2
WIRE_BYTES = {Compression.NONE: 4, Compression.BF16: 2, Compression.INT8: 1, Compression.INT4: 0.5}


@dataclass(frozen=True)
class Strategy:
    name: str
    sync: SyncConfig
    parallel: ParallelConfig = ParallelConfig()
    """FSDP2's settings (its units, resharding after forward), which the planner chooses for a job."""


def strategies(args: argparse.Namespace, compressions: list[Compression]) -> list[Strategy]:
    """``flat`` (DDP, as Ray Train's ``prepare_model`` builds it), ``hierarchical`` (FSDP2 inside each DC, each
    rank's rows summed across DCs after backward) and ``hierarchical+overlap`` (each block's rows summed across DCs
    from FSDP2's hook while backward runs, in chunks), the last two also with each inter-DC compression asked for."""
    common = {"inter_dc_chunk_mb": args.chunk_mb}
    out = [Strategy("flat", SyncConfig(strategy=SyncStrategy.FLAT, bucket_mb=args.bucket_mb))]
    for overlap, base in ((False, "hierarchical"), (True, "hierarchical+overlap")):
        for c in [Compression.NONE, *compressions]:
            name = base if c is Compression.NONE else f"{base}+{c.value}"
            out.append(Strategy(name, SyncConfig(overlap=overlap, compression=c, **common)))
    # the FSDP2 settings the planner chooses among: blocks kept gathered through the step, the model one unit
    for suffix, units in (("kept", FsdpUnits.BLOCK), ("one-unit", FsdpUnits.MODEL)):
        out.append(Strategy(f"hierarchical+overlap+{suffix}", SyncConfig(overlap=True, **common),
                            ParallelConfig(fsdp_units=units, reshard_after_forward=False)))
    outer = {"inner_steps": args.diloco_h, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    out.append(Strategy("diloco", SyncConfig(strategy=SyncStrategy.DILOCO, diloco=DiLoCoConfig(**outer), **common)))
    streaming = DiLoCoConfig(fragments=args.fragments, overlap_steps=args.overlap_steps, **outer)
    for c in [Compression.NONE, *compressions]:
        name = "streaming-diloco" if c is Compression.NONE else f"streaming-diloco+{c.value}"
        out.append(Strategy(name, SyncConfig(strategy=SyncStrategy.STREAMING_DILOCO, diloco=streaming, compression=c,
                                             **common)))  # fmt: skip
    if args.strategies:
        unknown = sorted(set(args.strategies) - {s.name for s in out})
        if unknown:
            raise ValueError(f"unknown --strategies {unknown}; choose from {[s.name for s in out]}")
        out = [s for s in out if s.name in args.strategies]
    return out


def job_config(args: argparse.Namespace, sync: SyncConfig, datacenters: tuple[str, ...], wan: WanConfig | None,
               parallel: ParallelConfig | None = None):
    world = len(datacenters)
    return TrainConfig(
        job_id=f"bench-sync-{args.dcs}x{args.workers_per_dc}",
        model=model_preset(args.model),
        steps=args.steps,
        global_batch=args.global_batch or 8 * world,
        micro_batch=args.micro_batch,
        datacenters=datacenters,
        sync=sync,
        optim=OptimConfig(warmup_steps=2),
        wan=wan,
        seed=args.seed,
        parallel=parallel or ParallelConfig(),
    )


def _run_rank(rank: int, world: int, rounds: int, configs: dict[str, TrainConfig]) -> dict:
    torch.set_num_threads(1)  # several ranks share this machine's cores
    out: dict[str, dict] = {
        name: {"step_s": [], "compute_s": [], "overlap": [], "bytes": [], "loss_tail": [], "result": None}
        for name in configs
    }
    for r in range(rounds):
        for name, cfg in configs.items():
            sink = ListSink()
            result = train(cfg, sink=sink, keep_params=r == 0)  # collective: FSDP2 gathers the weights
            timed = sink.records[WARMUP_STEPS:]
            o = out[name]
            o["step_s"] += [x.step_s for x in timed]
            o["compute_s"] += [x.step_s - x.sync_wait_s for x in timed]
            o["overlap"] += [x.overlap_fraction for x in timed]
            o["bytes"].append(result.inter_dc_bytes_per_step)
            o["loss_tail"].append(statistics.mean(x.loss for x in sink.records[-5:]) if rank == 0 else None)
            if r == 0:
                o["result"] = result
    return out


def run_strategies(
    args: argparse.Namespace, named: dict[str, SyncConfig], datacenters: tuple[str, ...], wan: WanConfig | None,
    parallel: dict[str, ParallelConfig] | None = None,
) -> list[dict]:
    configs = {name: job_config(args, sync, datacenters, wan, (parallel or {}).get(name))
               for name, sync in named.items()}
    return run_processes(_run_rank, len(datacenters), args.rounds, configs, timeout_s=args.timeout_s)


def layout(args: argparse.Namespace, *, one_dc: bool) -> tuple[str, ...]:
    names = [f"dc-{chr(ord('a') + i)}" for i in range(args.dcs)]
    if one_dc:
        return (names[0],) * (args.dcs * args.workers_per_dc)
    return tuple(dc for dc in names for _ in range(args.workers_per_dc))


def wan_of(args: argparse.Namespace) -> WanConfig | None:
    return None if args.no_wan else WanConfig(rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps)


def measure_link(wan: WanConfig | None) -> dict | None:
    if wan is None:
        return None
    from meridian.workers.wan.probe import probe

    got = probe(wan)
    return {"rtt_ms_measured": round(got["rtt_ms_measured"], 3), "gbps_measured": round(got["gbps_measured"], 4)}


def count_params(model: str) -> int:
    """Parameters the engines actually sync (trainable tensors of the built model)."""
    from meridian.workers.model.build import build_model

    return sum(p.numel() for p in build_model(model_preset(model)).parameters() if p.requires_grad)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run(args: argparse.Namespace) -> dict:
    check_args(args)
    compressions = [Compression(c) for c in args.compression]
    chosen = strategies(args, compressions)
    wan = wan_of(args)
    dcs = layout(args, one_dc=args.no_wan)
    per_rank = run_strategies(args, {s.name: s.sync for s in chosen}, dcs, wan, {s.name: s.parallel for s in chosen})
    params = count_params(args.model)
    num_dcs = len(set(dcs))
    flat = per_rank[0].get("flat")
    flat_params = flat["result"].final_params if flat else None
    report = {}
    for s in chosen:
        r0 = per_rank[0][s.name]
        theoretical = num_dcs * params * WIRE_BYTES[s.sync.compression] if num_dcs > 1 else 0
        if s.sync.strategy.is_diloco:
            theoretical = round(theoretical / s.sync.outer.inner_steps)
        measured_bytes = statistics.mean(r0["bytes"])
        report[s.name] = {
            "step_ms": round(1000 * statistics.median(r0["step_s"]), 2),
            "step_ms_mean": round(1000 * statistics.mean(r0["step_s"]), 2),
            "inter_dc_bytes_per_step": round(measured_bytes),
            "inter_dc_bytes_theoretical": theoretical,
            "bytes_vs_theoretical": round(measured_bytes / theoretical, 4) if theoretical else None,
            "max_abs_diff_vs_flat": max_abs_diff(r0["result"].final_params, flat_params) if flat_params else None,
            "optimizer_state_bytes_per_rank": max(r[s.name]["result"].optimizer_state_bytes for r in per_rank),
            "overlap_fraction": round(statistics.mean(r0["overlap"]), 4) if s.sync.strategy is not SyncStrategy.FLAT else None,
            "final_loss": round(r0["result"].final_loss, 5),
            "loss_last5": round(statistics.mean(r0["loss_tail"]), 5),
            "eval_loss": round(r0["result"].eval_loss, 5),
        }  # fmt: skip
    return {
        "model": args.model,
        "params": params,
        "datacenters": num_dcs,
        "workers": len(dcs),
        "steps": args.steps,
        "rounds": args.rounds,
        "wan": None if wan is None else {"rtt_ms": wan.rtt_ms, "gbps": wan.gbps},
        "emulation": measure_link(wan),
        "strategies": report,
        "diloco": {"inner_steps": args.diloco_h, "fragments": args.fragments, "overlap_steps": args.overlap_steps,
                   "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum},
        "quality": quality(report),
        "auto_choice": auto_choice(wan, params, len(dcs) // num_dcs, num_dcs, per_rank[0], args.model,
                                   micro_batches_per_rank(args.global_batch or 8 * len(dcs), len(dcs), args.micro_batch)),
    }


def micro_batches_per_rank(global_batch: int, ranks: int, micro_batch: int) -> int:
    """A rank's micro-batches per step (the most any rank has: the planner's hiding window is its last one)."""
    most = math.ceil(global_batch / ranks)
    return math.ceil(most / micro_batch)


def auto_choice(wan: WanConfig | None, params: int, per_dc: int, num_dcs: int, r0: dict, model: str,
                micro_batches: int = 1) -> dict | None:
    """What the planner's ``auto`` picks for this link and the compute time of a step measured here (median
    over every strategy's timed steps of step time minus time waiting for the sync)."""
    if wan is None or num_dcs < 2:
        return None
    from meridian.service.planning.cost_model import hierarchical_last_sync_mb
    from meridian.service.planning.sync_choice import choose_sync

    compute_s = statistics.median(x for r in r0.values() for x in r["compute_s"])
    c = choose_sync(rtt_ms=wan.rtt_ms, gbps=wan.gbps, num_params=params, compute_s=compute_s, num_dcs=num_dcs,
                    last_sync_mb=hierarchical_last_sync_mb(model_preset(model)), micro_batches=micro_batches)  # fmt: skip
    d = c.diloco
    return {"strategy": c.strategy.value, "compression": c.compression.value, "compute_s_measured": round(compute_s, 5),
            "inner_steps": d.inner_steps if d else None, "fragments": d.fragments if d else None,
            "overlap_steps": d.overlap_steps if d else None, "workers_per_dc": per_dc, "reason": c.explanation}  # fmt: skip


def quality(report: dict) -> dict | None:
    """Every strategy's losses at the same tokens, next to per-step HAR's (``hierarchical+overlap``)."""
    base = report.get("hierarchical+overlap") or report.get("hierarchical")
    if base is None:
        return None
    return {
        name: {"loss_last5": s["loss_last5"], "eval_loss": s["eval_loss"],
               "loss_last5_vs_har": round(s["loss_last5"] - base["loss_last5"], 5),
               "eval_loss_vs_har": round(s["eval_loss"] - base["eval_loss"], 5),
               "step_ms_mean_vs_har": round(s["step_ms_mean"] / base["step_ms_mean"], 4)}
        for name, s in report.items()
    }  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    if args.steps <= WARMUP_STEPS:
        raise ValueError(f"--steps must be more than the {WARMUP_STEPS} warm-up steps, got {args.steps}")
    if args.dcs < 1 or args.workers_per_dc < 1:
        raise ValueError("--dcs and --workers-per-dc must be at least 1")
    if not args.no_wan and args.dcs < 2:
        raise ValueError("an emulated WAN needs --dcs 2 or more (or pass --no-wan)")


def add_job_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The job every sync benchmark trains (``bench sync``, ``bench scaling``, ``bench lab``): its layout,
    model, batch and bucket sizes."""
    p.add_argument("--dcs", type=int, default=2, help="datacenters (default 2)")
    p.add_argument("--workers-per-dc", type=int, default=2, help="ranks per datacenter (default 2)")
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument("--global-batch", type=int, default=0, help="samples per step (default 8 per worker)")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per forward/backward (default 4)")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="flat sync's DDP bucket size (default 1)")
    p.add_argument("--chunk-mb", type=float, default=0.25, help="inter-DC chunk size (default 0.25)")
    p.add_argument("--seed", type=int, default=0)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    add_job_shape_arguments(p)
    p.add_argument("--rtt-ms", type=float, default=21.0, help="emulated inter-DC round trip (default 21)")
    p.add_argument("--inter-dc-gbps", type=float, default=1.0, help="emulated inter-DC bandwidth (default 1)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every strategy, interleaved (default 1)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up after this long (default 1800)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.add_argument("--no-wan", action="store_true", help="single-DC baseline: one datacenter, no emulation")
    p.add_argument(
        "--compression", nargs="*", default=["bf16", "int8"], choices=[c.value for c in Compression if c.value != "none"],
        help="inter-DC compressions to add to the hierarchical and streaming-diloco strategies (default: bf16 int8)",
    )  # fmt: skip
    p.add_argument("--strategies", nargs="*", default=[], help="run only these strategies (default: all)")
    p.add_argument("--diloco-h", type=int, default=8, help="DiLoCo inner steps H between syncs (default 8)")
    p.add_argument("--fragments", type=int, default=4, help="streaming DiLoCo fragments (default 4)")
    p.add_argument("--overlap-steps", type=int, default=1, help="streaming DiLoCo: steps a sync is in flight (default 1)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer Nesterov learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo outer momentum (default 0.9)")


def render(result: dict) -> str:
    em = result["emulation"]
    head = f"{result['model']} ({result['params']:,} params), {result['workers']} workers in {result['datacenters']} DC(s)"
    if em:
        head += f", WAN {result['wan']['rtt_ms']} ms / {result['wan']['gbps']} Gbit/s (measured {em['rtt_ms_measured']} ms / {em['gbps_measured']} Gbit/s)"
    rows = [head, f"{'strategy':<28}{'step ms':>9}{'inter-DC B/step':>17}{'x min':>7}{'max|Δ| vs flat':>16}{'opt B/rank':>12}{'overlap':>9}{'loss last5':>12}{'eval loss':>11}"]
    for name, s in result["strategies"].items():
        ratio = "-" if s["bytes_vs_theoretical"] is None else f"{s['bytes_vs_theoretical']:.3f}"
        ov = "-" if s["overlap_fraction"] is None else f"{s['overlap_fraction']:.2f}"
        diff = "-" if s["max_abs_diff_vs_flat"] is None else f"{s['max_abs_diff_vs_flat']:.2e}"
        rows.append(f"{name:<28}{s['step_ms']:>9.1f}{s['inter_dc_bytes_per_step']:>17,}{ratio:>7}{diff:>16}{s['optimizer_state_bytes_per_rank']:>12,}{ov:>9}{s['loss_last5']:>12.4f}{s['eval_loss']:>11.4f}")
    return "\n".join(rows)  # fmt: skip
