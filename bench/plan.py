"""``meridian bench plan``: does the planner's cost model predict the step times it ranks layouts by?

Command: ``meridian bench plan --json`` (defaults: the ``tiny`` model on 2 emulated DCs × 1 node × 1 CPU
slots, a 20 ms / 1 Gbit/s inter-DC link).

1. Measure the figures the planner needs on this machine, with every slot busy at once (as training runs):
   per-device training FLOP/s and the optimizer step of the model's own shape
   (:mod:`meridian.workers.probes.compute_bench`), and the local link (gloo all-reduce latency and bus bandwidth,
   :mod:`meridian.workers.probes.collective_bench`). The inter-DC link is the emulated WAN's configuration
   (:mod:`meridian.workers.wan.collectives`), which is what the collectives crossing DCs are paced by.
2. Ask the planner for every layout of the job on that (fake, local) topology, ranked by estimated step
   time, and take the top ``--top``.
3. Train each for real on local gloo processes (tensor/pipeline parallel as the layout says, the WAN
   emulator on every collective or send that crosses DCs), ``--rounds`` times interleaved, and take the
   median step time over the steps after the first ``WARMUP_STEPS``. Each run's processes first re-measure
   compute for ``PROBE_S`` seconds, all at once: the machine's load drifts between runs, so each candidate
   is predicted with the compute figures its own run saw (the links keep the first probe's figures).

Reports, per candidate, predicted vs measured step time and the relative error ``(predicted − measured) /
measured``, and whether the planner's ranking matches the measured one. Nothing here is tuned to the
answer: the estimates come from :func:`meridian.service.planning.cost_model.estimate` with the measured figures.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from meridian.service.cluster.topology import ClusterTopology, NodeInfo
from meridian.service.jobs import JobRequest, TopologyRequest
from meridian.service.planning.candidates import Candidate
from meridian.service.planning.cost_model import Figures, Link, estimate
from meridian.service.planning.planner import ranked_layouts, strategy_for
from meridian.workers.contracts.config import (
    OptimConfig,
    ParallelConfig,
    PipelineSchedule,
    Precision,
    SyncConfig,
    TrainConfig,
    WanConfig,
)
from meridian.workers.contracts.link_perf import message_sizes, summarise
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train
from meridian.workers.probes.collective_bench import all_reduce_perf
from meridian.workers.probes.compute_bench import training_flops

NAME = "plan"
HELP = "run the planner's top layouts on local processes: predicted vs measured step time, ranking, error"

WARMUP_STEPS = 3
PROBE_S = 1.5
TARGET_ERROR = 0.25


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="model preset (default: tiny)")
    p.add_argument("--dcs", type=int, default=2, help="emulated datacenters")
    p.add_argument("--nodes-per-dc", type=int, default=1)
    p.add_argument("--slots-per-node", type=int, default=1, help="worker slots (CPUs) per node")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help=f"optimizer steps per run (the first {WARMUP_STEPS} are warm-up)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every candidate, interleaved")
    p.add_argument("--top", type=int, default=4, help="candidates to run, best estimate first")
    p.add_argument("--rtt-ms", type=float, default=20.0)
    p.add_argument("--inter-dc-gbps", type=float, default=1.0)
    p.add_argument("--schedule", default="1f1b", choices=[s.value for s in PipelineSchedule])
    p.add_argument("--seed", type=int, default=0)


def _topology(args: argparse.Namespace) -> ClusterTopology:
    nodes = []
    for d in range(args.dcs):
        dc = f"dc-{chr(ord('a') + d)}"
        for n in range(args.nodes_per_dc):
            nodes.append(NodeInfo(
                node_id=f"{dc}-n{n}", datacenter=dc, alive=True, address="127.0.0.1", is_head=False,
                cpus=args.slots_per_node, gpus=0, memory_bytes=8 * 2**30, available_cpus=args.slots_per_node,
                available_gpus=0, labels={"datacenter": dc},
            ))
    return ClusterTopology(tuple(nodes))


def _probe(rank: int, world: int, model: str, micro_batch: int) -> dict[str, Any]:
    """Every slot at once: training FLOP/s of the model's shape, then the local all-reduce."""
    compute = training_flops(model_preset(model), micro_batch, min_seconds=2.0)
    rows = all_reduce_perf(message_sizes(8, 4 * 2**20, factor=8))
    return {"compute": compute, "link": summarise(rows).to_dict()}


def measure_figures(args: argparse.Namespace, slots: int) -> dict[str, Any]:
    """One probe: every slot at once, as training runs."""
    out = run_processes(_probe, slots, args.model, args.micro_batch, timeout_s=300)
    return {
        "device_gflops": statistics.mean(o["compute"]["flops"] for o in out) / 1e9,
        "optimizer_step_ms": statistics.mean(o["compute"]["optimizer_step_s"] for o in out) * 1e3,
        "local_latency_us": out[0]["link"]["latency_us"],
        "local_bandwidth_gbps": out[0]["link"]["bandwidth_gbps"],
    }


def to_figures(args: argparse.Namespace, probes: list[dict[str, Any]]) -> tuple[Figures, dict[str, Any]]:
    """The median of each probed figure over the rounds, and the emulated inter-DC link as configured."""
    med = {k: statistics.median(p[k] for p in probes) for k in probes[0]}
    # summarise() already gives the latency per ring round, which is what Link.latency_s is.
    local = Link(med["local_latency_us"] / 1e6, med["local_bandwidth_gbps"] * 1e9 / 8)
    wan = WanConfig(rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps)
    fig = Figures(device_flops=med["device_gflops"] * 1e9, device_memory_bytes=8 * 2**30, intra_node=local,
                  intra_dc=local, inter_dc=Link(wan.one_way_s, wan.bytes_per_s),
                  step_overhead_s=med["optimizer_step_ms"] / 1e3)
    return fig, {**{k: round(v, 3) for k, v in med.items()}, "per_round": probes,
                 "inter_dc": {"rtt_ms": args.rtt_ms, "gbps": args.inter_dc_gbps}}


def _request(args: argparse.Namespace, topo: ClusterTopology) -> JobRequest:
    return JobRequest(
        name="bench-plan", model=model_preset(args.model), steps=args.steps, global_batch=args.global_batch,
        micro_batch=args.micro_batch, seed=args.seed, precision=Precision.FP32,
        topology=TopologyRequest(datacenters=tuple(topo.datacenters)),
        wan=WanConfig(rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps),
    )


def job_config(args: argparse.Namespace, request: JobRequest, cand: Candidate, rank_dcs: tuple[str, ...]) -> TrainConfig:
    lay = cand.layout
    return TrainConfig(
        job_id=f"bench-plan-{lay.tp}-{lay.pp}-{lay.dp}", model=request.model, steps=args.steps,
        global_batch=args.global_batch, micro_batch=args.micro_batch, datacenters=rank_dcs,
        sync=SyncConfig(strategy=strategy_for(lay), overlap=request.sync.overlap),
        optim=OptimConfig(warmup_steps=2), wan=request.wan, seed=args.seed,
        parallel=ParallelConfig(tp=lay.tp, pp=lay.pp, schedule=PipelineSchedule(args.schedule)),
    )


def _train(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    """Probe compute on every rank at once (the figures this very run sees), then train the candidate."""
    compute = training_flops(cfg.model, cfg.micro_batch, min_seconds=PROBE_S)
    sink = ListSink()
    train(cfg, sink=sink)
    return {"step_s": [r.step_s for r in sink.records], "flops": compute["flops"],
            "optimizer_step_s": compute["optimizer_step_s"]}


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for pos, i in enumerate(order):
        out[i] = pos + 1
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.steps <= WARMUP_STEPS:
        raise ValueError(f"--steps must be > {WARMUP_STEPS} (the first {WARMUP_STEPS} are warm-up)")
    topo = _topology(args)
    slots = args.dcs * args.nodes_per_dc * args.slots_per_node
    request = _request(args, topo)
    probes = [measure_figures(args, slots)]  # what the planner ranks the candidates with
    ranked = ranked_layouts(request, topo, to_figures(args, probes)[0])[: args.top]
    if not ranked:
        raise ValueError("the planner found no layout for this job on this topology")
    times: list[list[float]] = [[] for _ in ranked]
    run_probes: list[list[dict[str, Any]]] = [[] for _ in ranked]
    for _ in range(args.rounds):
        for i, (cand, rank_dcs) in enumerate(ranked):
            cfg = job_config(args, request, cand, rank_dcs)
            out = run_processes(_train, len(rank_dcs), cfg, timeout_s=600)
            times[i] += out[0]["step_s"][WARMUP_STEPS:]
            run_probes[i].append({
                **probes[0],
                "device_gflops": statistics.mean(o["flops"] for o in out) / 1e9,
                "optimizer_step_ms": statistics.mean(o["optimizer_step_s"] for o in out) * 1e3,
            })
    figures, measured_figures = to_figures(args, probes)
    # Each candidate is predicted with the compute figures its own processes measured right before training
    # (the machine's load drifts between runs); the link figures are the first probe's.
    estimates = [estimate(request.model, c.layout, to_figures(args, run_probes[i])[0], args.global_batch)
                 for i, (c, _) in enumerate(ranked)]
    measured = [statistics.median(t) for t in times]
    predicted = [e.step_s for e in estimates]
    rows = []
    for i, ((cand, rank_dcs), e, pred, meas, pr, mr) in enumerate(zip(
        ranked, estimates, predicted, measured, _ranks(predicted), _ranks(measured), strict=True
    )):
        rows.append({
            "layout": cand.name, "tp": cand.layout.tp, "pp": cand.layout.pp, "dp": cand.layout.dp,
            "sync": strategy_for(cand.layout).value, "workers": len(rank_dcs), "rank_datacenters": list(rank_dcs),
            "predicted_step_ms": round(pred * 1e3, 2), "measured_step_ms": round(meas * 1e3, 2),
            "relative_error": round((pred - meas) / meas, 3), "predicted_rank": pr, "measured_rank": mr,
            "run_device_gflops": round(statistics.median(p["device_gflops"] for p in run_probes[i]), 2),
            "estimate_ms": {k: round(getattr(e, k) * 1e3, 2)
                            for k in ("compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "exposed_dp_s")},
        })
    errors = [abs(r["relative_error"]) for r in rows]
    rows.sort(key=lambda r: r["predicted_rank"])
    return {
        "benchmark": "plan",
        "model": args.model, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
        "steps": args.steps, "rounds": args.rounds, "schedule": args.schedule,
        "topology": {"dcs": args.dcs, "nodes_per_dc": args.nodes_per_dc, "slots_per_node": args.slots_per_node},
        "figures": measured_figures,
        "candidates": sorted(rows, key=lambda r: r["predicted_rank"]),
        "ranking_matches": [r["predicted_rank"] for r in rows] == [r["measured_rank"] for r in rows],
        "best_matches": rows[0]["measured_rank"] == 1,
        "max_abs_relative_error": max(errors),
        "within_target": sum(err <= TARGET_ERROR for err in errors),
        "target_relative_error": TARGET_ERROR,
    }


def render(result: dict[str, Any]) -> str:
    head = f"{'layout':34} {'workers':>7} {'predicted ms':>12} {'measured ms':>11} {'error':>7} {'rank p/m':>8}"
    lines = [head, "-" * len(head)]
    for r in result["candidates"]:
        lines.append(f"{r['layout']:34} {r['workers']:>7} {r['predicted_step_ms']:>12.1f} {r['measured_step_ms']:>11.1f} "
                     f"{r['relative_error']:>+7.0%} {r['predicted_rank']:>4}/{r['measured_rank']}")
    lines.append(f"ranking matches: {result['ranking_matches']}; within ±{result['target_relative_error']:.0%}: "
                 f"{result['within_target']}/{len(result['candidates'])}")
    return "\n".join(lines)
