"""``meridian bench lowcomm``: per-step sync against DiLoCo, streaming DiLoCo and torchft's DiLoCo, over
thousands of steps on a far, slow link.

Every strategy trains the same model from the same seed on the same samples for the same number of steps
(equal tokens) on ``--dcs`` processes, one per datacenter (gloo), and is evaluated on the same held-out
batches after its last step (for DiLoCo: rank 0's datacenter replica). Strategies run one after the other in
the same processes, so machine load hits them alike only in expectation: the report carries the load
average before and after.

- ``har``: per-step hierarchical sync (``hierarchical``, each FSDP2 unit synced behind backward, fp32);
- ``har-delayed``: the same sync applied one step late (``sync.delay_one_step``), behind the whole next step;
- ``har-lookahead``: the same, each step computed at the datacenter's own look-ahead (``sync.local_lookahead``),
  what ``auto`` picks when the sync fits behind a step (:mod:`meridian.service.planning.sync_choice`);
- ``har+bf16``: per-step sync with the inter-DC exchange in bf16 (error feedback): half the bytes, what
  ``auto`` picks when that hides the link and the look-ahead cannot; these three only when
  ``--strategies`` names them (each takes minutes of per-step waits on the slow link);
- ``diloco+int8|int4/H<h>``: Meridian's DiLoCo (:mod:`meridian.workers.sync.diloco`), outer deltas in int8 or
  4 bits with error feedback (:mod:`meridian.workers.sync.compression`);
- ``streaming-diloco+int8|int4/H<h>``: the same with ``--fragments`` fragments, each in flight behind
  ``--overlap-steps`` inner steps and merged as ``--merge`` says when it lands (default: the paper's mix, as a
  job's; :class:`~meridian.workers.contracts.config.OuterMerge`);
- ``sparse-diloco/<b>bit/d<density>/H<h>``, ``sparse-streaming-diloco/<b>bit/d<density>/H<h>``: the sparse outer
  update (SparseLoCo, arXiv:2508.15706; :mod:`meridian.workers.sync.sparse_codec`): top-k of each 4,096-element
  block of the outer delta at ``--sparse-density``, values in ``--sparse-value-bits`` bits, error feedback decayed by
  ``--sparse-error-decay``, outer step ``--sparse-outer-lr`` / ``--sparse-outer-momentum``, streaming merge
  ``--sparse-merge``; plain and streaming; ``+keep`` after the kind: each datacenter keeps its unsent residual in
  its weights (``--sparse-unsent keep``, the default; ``restart`` is SparseLoCo's, every datacenter restarting from
  the outer weights);
- ``torchft-diloco/H<h>``, ``torchft-streaming-diloco/H<h>``: torchft's ``DiLoCo``
  (:mod:`meridian.bench.lowcomm_torchft`), same fragments and delay, with torchft's merge (the paper's, local
  weight ``--mix-alpha``).

``--sweep`` runs the sparse rows of every ``--inner-steps`` × ``--sparse-density`` × ``--sparse-value-bits``
combination (beside ``har`` and torchft's rows at each H, nothing else) and adds one table of them, ``sweep``
(also written as Markdown to ``--sweep-table``).

With ``--lab`` (root) Meridian's strategies run as processes inside ``meridian lab``'s datacenter namespaces,
their inter-DC traffic real TCP through the lab's delay line and ``tbf`` at ``--rtt-ms`` / ``--inter-dc-gbps``
(brought up without Ray under the machine's lab lock, and down again), nothing emulated inside Meridian; each
row then adds what the kernel counted on the link (``inter_dc_bytes_kernel_per_step``). torchft's rows are not
run there (its processes are this bench's own, on loopback).

Per strategy, all measured: ``inter_dc_bytes_per_step`` (bytes handed to the collectives that cross DCs,
summed over ranks, divided by steps), ``bytes_reduction_vs_har``, ``final_val_loss``, ``loss_gap_vs_har``
(relative), ``wall_s`` (first step's start to last step's end on rank 0), ``compute_utilisation`` (time
computing ÷ wall: each rank's steps' time less what they waited for inter-DC sync, over all ranks, ÷ their loops'
walls; time a loop spends between steps, or waiting for a slower datacenter, counts against it; each rank's in
``compute_utilisation_per_rank``) and ``not_blocked_in_sync`` (rank 0: 1 − what its steps waited for their sync
÷ ``wall_s``). ``auto_choice`` is what the planner
(:func:`meridian.service.planning.lowcomm_choice.choose_lowcomm`) picks for the link and the measured compute time
of a step, with its reason. ``link`` says whether the link was the lab's or the application's emulator.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meridian.bench import corpus
from meridian.bench.lowcomm_torchft import TorchftOuter, run_torchft
from meridian.service.planning.sync_choice import (
    OVERLAP_MARGIN,
    cross_dc_time,
    max_overlap_steps,
    overlap_steps_for,
)
from meridian.workers.contracts.config import (
    Compression,
    DataConfig,
    DiLoCoConfig,
    FinalAverage,
    OptimConfig,
    OuterMerge,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
    ValidationConfig,
    WanConfig,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.sync.compression import payload_nbytes
from meridian.workers.sync.diloco_schedule import warmup_cycle

NAME = "lowcomm"
HELP = "per-step sync vs DiLoCo / streaming DiLoCo (int8, int4) vs torchft's DiLoCo over 1000+ steps on a slow link"

TAIL = 50  # training-loss steps averaged at the end
LAB_NAME = "bench-lowcomm"


@dataclass(frozen=True)
class Strategy:
    name: str
    sync: SyncConfig | None = None
    """Meridian's engine; ``None`` for torchft."""
    torchft: TorchftOuter | None = None
    by_default: bool = True
    """Run without ``--strategies``; the per-step variants are opt-in (each takes minutes on the slow link)."""


def sparse_name(kind: str, bits: int, density: float, h: int) -> str:
    return f"{kind}/{bits}bit/d{density:g}/H{h}"


def averaged(final: str) -> str:
    """A DiLoCo row's name suffix for its ``final_average`` (none when off)."""
    return "" if final == FinalAverage.OFF.value else f"/avg-{final}"


def strategies(args: argparse.Namespace) -> list[Strategy]:
    common = {"inter_dc_chunk_mb": args.chunk_mb}
    out = [Strategy("har", SyncConfig(strategy=SyncStrategy.HIERARCHICAL, overlap=True, **common)),
           Strategy("har-delayed", SyncConfig(strategy=SyncStrategy.HIERARCHICAL, delay_one_step=True, **common),
                    by_default=False),
           Strategy("har-lookahead", SyncConfig(strategy=SyncStrategy.HIERARCHICAL, delay_one_step=True,
                                                local_lookahead=True, **common), by_default=False),
           Strategy("har+bf16", SyncConfig(strategy=SyncStrategy.HIERARCHICAL, overlap=True,
                                           compression=Compression.BF16, **common), by_default=False)]
    for h in args.inner_steps:
        outer = {"inner_steps": h, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
        plain = DiLoCoConfig(**outer)  # no warm-up: syncing every H/4 steps with the outer momentum overshot (+25-45%)
        tau = overlap_steps(args, h)
        streaming = DiLoCoConfig(fragments=args.fragments, overlap_steps=tau, merge=OuterMerge(args.merge),
                                 mix_alpha=args.mix_alpha,
                                 warmup_steps=_whole_cycles(args.diloco_warmup_steps, h, args.fragments, tau),
                                 **outer)  # fmt: skip
        for kind, strategy, cfg in (("diloco", SyncStrategy.DILOCO, plain),
                                    ("streaming-diloco", SyncStrategy.STREAMING_DILOCO, streaming)):  # fmt: skip
            for c, final in itertools.product(args.compression, args.final_average):
                sync = SyncConfig(strategy=strategy, diloco=dataclasses.replace(cfg, final_average=FinalAverage(final)),
                                  compression=Compression(c), **common)  # fmt: skip
                out.append(Strategy(f"{kind}+{c}/H{h}" + averaged(final), sync, by_default=not args.sweep))
            for density, bits, unsent, final in itertools.product(args.sparse_density, args.sparse_value_bits,
                                                                  args.sparse_unsent, args.final_average):  # fmt: skip
                sparse = dataclasses.replace(
                    cfg, outer_lr=args.sparse_outer_lr, outer_momentum=args.sparse_outer_momentum,
                    merge=OuterMerge(args.sparse_merge),
                    sparse_density=density, sparse_value_bits=bits, sparse_block=args.sparse_block,
                    sparse_error_decay=args.sparse_error_decay, sparse_keep_unsent=unsent == "keep",
                    final_average=FinalAverage(final))  # fmt: skip
                sync = SyncConfig(strategy=strategy, diloco=sparse, **common)
                label = f"sparse-{kind}" + ("+keep" if unsent == "keep" else "")
                out.append(Strategy(sparse_name(label, bits, density, h) + averaged(final), sync))
        ft = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
        out.append(Strategy(f"torchft-diloco/H{h}", torchft=TorchftOuter(h, **ft)))
        out.append(Strategy(f"torchft-streaming-diloco/H{h}", torchft=TorchftOuter(
            h, fragments=args.fragments, sync_delay=min(tau, h // args.fragments - 1), alpha=args.mix_alpha,
            **ft)))  # fmt: skip  torchft 0.2 syncs a fragment before the next one starts: sync_delay < H / fragments
    if args.strategies:
        unknown = sorted(set(args.strategies) - {s.name for s in out})
        if unknown:
            raise ValueError(f"unknown --strategies {unknown}; choose from {[s.name for s in out]}")
        return [s for s in out if s.name in args.strategies or s.name == "har"]  # har is the baseline
    return [s for s in out if s.by_default]


def overlap_steps(args: argparse.Namespace, h: int) -> int:
    """Streaming: the inner steps a fragment's sync stays in flight: ``--overlap-steps``, or by default what ``auto``
    picks for the link and a step measured on this machine (:func:`overlap_rule`), at most a third of H."""
    if args.overlap_steps is not None:
        return min(args.overlap_steps, h - 1)
    return min(args.overlap_rule["overlap_steps"], max_overlap_steps(h))


PROBE_STEPS = 64


def overlap_rule(args: argparse.Namespace, params: int) -> dict[str, Any]:
    """``auto``'s overlap (:func:`~meridian.service.planning.sync_choice.overlap_steps_for`) for this link, the
    largest fragment the chosen encodings send, and a step's compute measured here: the median of a short plain
    DiLoCo run's steps over loopback (nothing to wait for), after its first 8."""
    from meridian.workers.distributed.multiproc import run_processes

    sync = SyncConfig(strategy=SyncStrategy.DILOCO, diloco=DiLoCoConfig(inner_steps=args.inner_steps[0]),
                      inter_dc_chunk_mb=args.chunk_mb)  # fmt: skip
    probe = dataclasses.replace(job_config(args, sync, emulated=False), steps=PROBE_STEPS, validation=None)
    ranks = run_processes(_meridian, args.dcs, probe, timeout_s=args.timeout_s)
    compute_s = statistics.median(a - b for r in ranks for a, b in zip(r["step_s"][8:], r["blocked_s"][8:], strict=True))
    frag_bytes = max(payload_nbytes(Compression(c), -(-params // args.fragments)) for c in args.compression or ["none"])
    frag_s = cross_dc_time(frag_bytes, rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps, num_dcs=args.dcs)
    return {"compute_s_probe": round(compute_s, 5), "fragment_sync_s": round(frag_s, 5),
            "overlap_steps": overlap_steps_for(frag_s, compute_s),
            "rule": f"ceil({OVERLAP_MARGIN:g} x fragment sync / step compute), at most a third of H, as auto "
                    "picks it"}  # fmt: skip


def _whole_cycles(steps: int, h: int, fragments: int, overlap_steps: int) -> int:
    """``steps`` rounded down to whole warm-up cycles of this H, fragments and overlap; none when that cycle is no
    shorter than H (it would sync no more often)."""
    cycle = warmup_cycle(h, fragments, overlap_steps)
    return steps // cycle * cycle if cycle < h else 0


def datacenters(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(f"dc-{chr(ord('a') + i)}" for i in range(args.dcs))


def job_config(args: argparse.Namespace, sync: SyncConfig | None, *, emulated: bool = True) -> TrainConfig:
    """The job every strategy trains; ``emulated``: behind the app's WAN emulator (not over the lab)."""
    return TrainConfig(
        job_id="bench-lowcomm", model=model_preset(args.model), steps=args.steps, global_batch=args.global_batch,
        micro_batch=args.micro_batch, datacenters=datacenters(args), sync=sync or SyncConfig(),
        data=DataConfig(source=args.corpus.source, max_bytes=args.data_max_bytes),
        optim=OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps), seed=args.seed,
        wan=WanConfig(rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps) if emulated else None,
        validation=ValidationConfig(every_steps=args.steps, batches=args.val_batches),
    )  # fmt: skip


def _meridian(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    from meridian.bench.lab_worker import run_rank

    return _as_run(run_rank(rank, world, cfg))


def _as_run(r: dict[str, Any]) -> dict[str, Any]:
    """A rank's :func:`~meridian.bench.lab_worker.run_rank` output (behind the emulator or in the lab) as
    :func:`summarise` reads a strategy (the loss and bytes only on rank 0, which reports them)."""
    return {"step_s": r["step_s"], "blocked_s": r["sync_wait_s"], "loop_wall_s": r["loop_wall_s"],
            "val_loss": r["val_loss"], "losses": r["loss"], "inter_dc_bytes": sum(r["inter_dc_bytes"])}  # fmt: skip


def _timing(r: dict[str, Any]) -> dict[str, float]:
    """One rank's time computing (its steps' time less what they waited for inter-DC sync) and its loop's wall."""
    return {"computing_s": sum(r["step_s"]) - sum(r["blocked_s"]), "wall_s": r["loop_wall_s"]}


def _with_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's run of a strategy, with every rank's timing."""
    return {**ranks[0], "ranks": [_timing(r) for r in ranks]}


def _run_rank(rank: int, world: int, jobs: list[tuple[str, TrainConfig, TorchftOuter | None]], val_batches: int):
    import torch

    torch.set_num_threads(1)
    out = {}
    for name, cfg, outer in jobs:
        t0 = time.perf_counter()
        got = run_torchft(rank, cfg, outer, val_batches) if outer is not None else _meridian(rank, world, cfg)
        got["run_s"] = time.perf_counter() - t0
        out[name] = got
    return out


def run_on_lab(args: argparse.Namespace, chosen: list[Strategy]) -> dict[str, dict[str, Any]]:
    """Meridian's strategies as processes in the lab's namespaces, one rank per datacenter (real TCP)."""
    from meridian.bench.lab import lab_lock, run_in_lab
    from meridian.lab import lab as lab_mod

    if os.geteuid() != 0:
        raise RuntimeError("--lab creates network namespaces: run `meridian bench lowcomm --lab` as root")
    names = datacenters(args)
    out = {}
    with tempfile.TemporaryDirectory(prefix="meridian-bench-lowcomm-") as tmp, lab_lock(args.lock, args.lock_timeout_s):
        state = lab_mod.up({dc: 1 for dc in names}, rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps, name=LAB_NAME,
                           ray=False)  # fmt: skip
        try:
            for s in chosen:
                t0 = time.perf_counter()
                ranks = run_in_lab(state, job_config(args, s.sync, emulated=False), list(names), Path(tmp),
                                   args.timeout_s, count_at=(1, args.steps))  # fmt: skip
                out[s.name] = from_lab(ranks, time.perf_counter() - t0)
        finally:
            lab_mod.down(LAB_NAME)
    return out


def from_lab(ranks: list[dict[str, Any]], run_s: float) -> dict[str, Any]:
    """A lab run's ranks as :func:`summarise` reads a strategy, plus the kernel's count of the inter-DC bytes
    over the steps after the first (which also sets up the connections), against what the engines reported
    for the same steps (:func:`meridian.bench.lab.summarise`)."""
    from meridian.bench.lab import summarise as lab_summarise

    got = {**_with_ranks([_as_run(r) for r in ranks]), "run_s": run_s}
    steps = len(ranks[0]["step_s"])
    if steps > 1:
        counted = lab_summarise(ranks, (1, steps), use_mean=True)
        if "kernel" in counted:
            got["kernel_per_step"], got["reported_per_step_after_first"] = counted["kernel"], counted["reported"]
    return got


def summarise(name: str, s: Strategy, got: dict[str, Any], steps: int) -> dict[str, Any]:
    blocked, wall = sum(got["blocked_s"]), got["loop_wall_s"]
    # Each rank's time computing (its steps' own time, less what they waited for the link) ÷ its wall; the job's
    # figure is all ranks' computing ÷ all ranks' wall (a rank that waits for a slower peer counts against it).
    ranks = got["ranks"]
    utilisation = sum(r["computing_s"] for r in ranks) / sum(r["wall_s"] for r in ranks)
    row: dict[str, Any] = {
        "engine": "torchft" if s.torchft else "meridian",
        "inter_dc_bytes_per_step": round(got["inter_dc_bytes"] / steps, 1),
        "final_val_loss": round(got["val_loss"], 5),
        "train_loss_last50": round(statistics.mean(got["losses"][-TAIL:]), 5),
        "wall_s": round(wall, 2),
        "run_s": round(got["run_s"], 2),
        "step_ms_mean": round(1000 * statistics.mean(got["step_s"]), 2),
        "blocked_s": round(blocked, 3),
        # time computing ÷ wall: whatever else holds the loop (waiting on the link inside a step, or between
        # steps, e.g. for the loop's own loss sums across datacenters) counts against it
        "compute_utilisation": round(utilisation, 4),
        "compute_utilisation_per_rank": [round(r["computing_s"] / r["wall_s"], 4) for r in ranks],
        "not_blocked_in_sync": round(1 - blocked / wall, 4),  # rank 0: 1 − what its steps waited for sync ÷ wall
    }
    if "kernel_per_step" in got:
        row["inter_dc_bytes_kernel_per_step"] = round(got["kernel_per_step"], 1)
        row["reported_vs_kernel"] = round(got["reported_per_step_after_first"] / got["kernel_per_step"], 4)
    if s.sync is not None and s.sync.strategy.is_diloco:
        o = s.sync.outer
        row.update(inner_steps=o.inner_steps, fragments=o.fragments, overlap_steps=o.overlap_steps,
                   compression=s.sync.compression.value, outer_lr=o.outer_lr, outer_momentum=o.outer_momentum,
                   warmup_steps=o.warmup_steps, merge=o.merge.value if o.overlap_steps else None,
                   final_average=o.final_average.value)  # fmt: skip
        if o.sparse_density is not None:
            row.update(compression="sparse", sparse_density=o.sparse_density, sparse_value_bits=o.sparse_value_bits,
                       sparse_block=o.sparse_block, sparse_error_decay=o.sparse_error_decay,
                       sparse_keep_unsent=o.sparse_keep_unsent)  # fmt: skip
    elif s.torchft is not None:
        t = s.torchft
        row.update(inner_steps=t.inner_steps, fragments=t.fragments, overlap_steps=t.sync_delay, compression="none",
                   outer_lr=t.outer_lr, outer_momentum=t.outer_momentum, collective_calls=got["collective_calls"],
                   commits=got["commits"])  # fmt: skip
    return row


def compare(report: dict[str, dict[str, Any]]) -> None:
    """Ratios to per-step sync, and the issue's goals per strategy (torchft's best in the same run)."""
    har = report["har"]
    ft = [r for r in report.values() if r["engine"] == "torchft"]
    for r in report.values():
        r["bytes_reduction_vs_har"] = round(har["inter_dc_bytes_per_step"] / r["inter_dc_bytes_per_step"], 2)
        r["loss_gap_vs_har"] = round((r["final_val_loss"] - har["final_val_loss"]) / har["final_val_loss"], 5)
    for r in report.values():
        if r["engine"] != "meridian" or r is har:
            continue
        r["goals"] = {
            "bytes_2000x": r["bytes_reduction_vs_har"] >= 2000,
            "loss_within_1pct": r["loss_gap_vs_har"] <= 0.01,
            "utilisation_97pct": r["compute_utilisation"] >= 0.97,
            # None: no torchft row ran to compare with
            "bytes_le_torchft": all(r["inter_dc_bytes_per_step"] <= f["inter_dc_bytes_per_step"] for f in ft) if ft else None,
            "loss_le_torchft": r["final_val_loss"] <= min(f["final_val_loss"] for f in ft) if ft else None,
        }  # fmt: skip


SWEEP_COLUMNS = ("strategy", "inner_steps", "sparse_density", "sparse_value_bits", "bytes_reduction_vs_har",
                 "loss_gap_vs_har", "final_val_loss", "compute_utilisation")


def sweep_table(report: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The sparse rows of a ``--sweep`` run, one per (kind, H, density, bits), with torchft's best row at each H
    and per-step sync's for reference: what the sweep's table shows."""
    rows = [{"strategy": name, **{c: r.get(c) for c in SWEEP_COLUMNS[1:]}}
            for name, r in report.items() if r.get("compression") == "sparse" or name == "har"]  # fmt: skip
    for h in sorted({r["inner_steps"] for r in report.values() if r["engine"] == "torchft"}):
        ft = [(n, r) for n, r in report.items() if r["engine"] == "torchft" and r["inner_steps"] == h]
        name, best = min(ft, key=lambda nr: nr[1]["final_val_loss"])
        rows.append({"strategy": f"{name} (torchft's best at H={h})", **{c: best.get(c) for c in SWEEP_COLUMNS[1:]}})
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rows`` as one Markdown table (the sweep's)."""
    def cell(v: Any) -> str:
        return "—" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(SWEEP_COLUMNS) + " |", "|" + "---|" * len(SWEEP_COLUMNS)]
    out += ["| " + " | ".join(cell(r.get(c)) for c in SWEEP_COLUMNS) + " |" for r in rows]
    return "\n".join(out) + "\n"


def auto_choice(args: argparse.Namespace, params: int, per_rank: dict[str, Any], chosen: list[Strategy]) -> dict:
    """The planner's pick for the link and the compute time of a step measured here (the median over the
    first DiLoCo run's steps of step time minus blocked time: pure compute, data and optimizer)."""
    from meridian.bench.sync import micro_batches_per_rank
    from meridian.service.planning.cost_model import hierarchical_last_sync_mb
    from meridian.service.planning.lowcomm_choice import choose_lowcomm

    ref = next((s.name for s in chosen if s.sync is not None and s.sync.strategy.is_diloco), "har")
    got = per_rank[ref]
    compute_s = statistics.median(a - b for a, b in zip(got["step_s"], got["blocked_s"], strict=True))
    c = choose_lowcomm(rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps, num_params=params, compute_s=compute_s,
                    num_dcs=args.dcs, last_sync_mb=hierarchical_last_sync_mb(model_preset(args.model)), steps=args.steps,
                    micro_batches=micro_batches_per_rank(args.global_batch, args.dcs, args.micro_batch))  # fmt: skip
    d = c.diloco
    return {
        "link": {"rtt_ms": args.rtt_ms, "gbps": args.inter_dc_gbps}, "compute_s_measured": round(compute_s, 5),
        "strategy": c.strategy.value, "compression": c.compression.value,
        "inner_steps": d.inner_steps if d else None, "fragments": d.fragments if d else None,
        "overlap_steps": d.overlap_steps if d else None, "sparse_density": d.sparse_density if d else None,
        "reason": c.explanation,
    }  # fmt: skip


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def run(args: argparse.Namespace) -> dict:
    from meridian.bench.sync import count_params

    if args.dcs < 2:
        raise ValueError("--dcs must be at least 2: the bench measures the link between datacenters")
    params = count_params(args.model)
    with tempfile.TemporaryDirectory(prefix="meridian-bench-corpus-") as tmp:
        args.corpus = corpus.prepare(args.data_source, args.data_max_bytes, tmp)
        return _run(args, params)


def _run(args: argparse.Namespace, params: int) -> dict:
    from meridian.bench.sync import measure_link
    from meridian.workers.distributed.multiproc import run_processes

    if args.overlap_steps is None:
        args.overlap_rule = overlap_rule(args, params)
    chosen = strategies(args)
    if args.lab:
        chosen = [s for s in chosen if s.torchft is None]
    load_before, t0 = loadavg(), time.perf_counter()
    if args.lab:
        per_rank = run_on_lab(args, chosen)
    else:
        jobs = [(s.name, job_config(args, s.sync), s.torchft) for s in chosen]
        ranks = run_processes(_run_rank, args.dcs, jobs, args.val_batches, timeout_s=args.timeout_s)
        per_rank = {name: _with_ranks([r[name] for r in ranks]) for name, _, _ in jobs}  # rank 0's run_s with it
    total_s = time.perf_counter() - t0
    report = {s.name: summarise(s.name, s, per_rank[s.name], args.steps) for s in chosen}
    compare(report)
    tokens = args.steps * args.global_batch * model_preset(args.model).seq_len
    sweep = sweep_table(report) if args.sweep else None
    if sweep is not None and args.sweep_table:
        Path(args.sweep_table).write_text(markdown_table(sweep))
    return {
        "command": "meridian bench lowcomm " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", NAME] else sys.argv[1:]),
        "model": args.model, "params": params, "datacenters": args.dcs, "ranks_per_dc": 1, "steps": args.steps,
        "global_batch": args.global_batch, "tokens_per_strategy": tokens,
        "data": {"source": args.corpus.name, "sha256": args.corpus.sha256, "train_tokens": args.corpus.train_bytes,
                 "epochs": round(tokens / args.corpus.train_bytes, 2)},
        "lr": args.lr, "warmup_steps": args.warmup_steps, "val_batches": args.val_batches,
        "link": {"kind": "lab", "rtt_ms": args.rtt_ms, "gbps": args.inter_dc_gbps,
                 "note": "meridian lab's real TCP link (delay line + tbf), nothing emulated inside Meridian; "
                         "torchft's rows were not run (they run on loopback behind a model of the link)"}
        if args.lab else
        {"kind": "emulated", "rtt_ms": args.rtt_ms, "gbps": args.inter_dc_gbps,
         "measured": measure_link(WanConfig(rtt_ms=args.rtt_ms, gbps=args.inter_dc_gbps)),
         "note": "the application's WAN emulator (workers/wan) for Meridian; the same α–β model in "
                 "bench/lowcomm_torchft.py for torchft; the lab's real link was not used (--lab uses it)"},
        "strategies": report,
        "sweep": sweep,
        "overlap_rule": getattr(args, "overlap_rule", None),
        "auto_choice": auto_choice(args, params, per_rank, chosen),
        "total_s": round(total_s, 1), "loadavg_before": load_before, "loadavg_after": loadavg(), "cpus": os.cpu_count(),
    }  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dcs", type=int, default=2, help="datacenters, one rank each (default 2)")
    p.add_argument("--rtt-ms", type=float, default=100.0, help="inter-DC round trip (default 100)")
    p.add_argument("--inter-dc-gbps", type=float, default=0.1, help="inter-DC bandwidth (default 0.1)")
    p.add_argument("--model", default="nano", help="model preset (default nano)")
    p.add_argument("--steps", type=int, default=2048, help="optimizer steps per strategy (default 2048)")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step over all DCs (default 64)")
    p.add_argument("--micro-batch", type=int, default=32, help="samples per forward/backward (default 32)")
    p.add_argument("--lr", type=float, default=5e-3,
                   help="inner AdamW peak learning rate, every strategy (default 5e-3: per-step sync's better of 3e-3, 5e-3)")
    p.add_argument("--warmup-steps", type=int, default=50, help="inner learning-rate warm-up (default 50)")
    p.add_argument("--val-batches", type=int, default=16, help="held-out micro-batches evaluated (default 16)")
    p.add_argument("--inner-steps", type=int, nargs="+", default=[32], help="DiLoCo H values (default 32)")
    p.add_argument("--compression", nargs="+", default=["int8", "int4"], choices=["none", "bf16", "int8", "int4"],
                   help="outer-delta encodings for Meridian's DiLoCo (default int8 int4)")  # fmt: skip
    p.add_argument("--sparse-density", type=float, nargs="*", default=[0.02],
                   help="sparse rows: share of each block's outer delta sent, one row pair per value (default 0.02; "
                        "none: no sparse rows)")
    p.add_argument("--sparse-value-bits", type=int, nargs="+", default=[2], choices=[2, 4, 8],
                   help="sparse rows: bits per value sent (default 2)")
    p.add_argument("--sparse-block", type=int, default=4096, help="sparse rows: elements per top-k block (default 4096)")
    p.add_argument("--sparse-error-decay", type=float, default=1.0,
                   help="sparse rows: what is left of the residual at each sync (default 1: plain error feedback)")
    p.add_argument("--sparse-unsent", nargs="+", default=["keep"], choices=["restart", "keep"],
                   help="sparse rows: what a datacenter's weights become when a sync lands: the outer weights "
                        "(restart, SparseLoCo's) or those plus its own unsent residual (keep, the default: rows named "
                        "'+keep'; sync.diloco.sparse_keep_unsent)")
    p.add_argument("--sparse-outer-lr", type=float, default=2.0,
                   help="sparse rows: outer learning rate (default 2: each of the 2 datacenters' sent progress counts "
                        "whole)")
    p.add_argument("--sparse-outer-momentum", type=float, default=0.0,
                   help="sparse rows: outer Nesterov momentum (default 0)")
    p.add_argument("--sparse-merge", default=OuterMerge.KEEP_PROGRESS.value, choices=[m.value for m in OuterMerge],
                   help="sparse streaming rows: what a fragment becomes when its sync lands (default keep-progress)")
    p.add_argument("--final-average", nargs="+", default=[FinalAverage.OFF.value],
                   choices=[f.value for f in FinalAverage],
                   help="Meridian's DiLoCo rows: the datacenters average their weights at the last step, in this "
                        "encoding (its bytes counted in that step's), and the row's model is the average; one row per "
                        "value (default off: the first datacenter's weights)")
    p.add_argument("--sweep", action="store_true",
                   help="run only the sparse rows of every --inner-steps x --sparse-density x --sparse-value-bits "
                        "(beside har and torchft's rows) and add their table (sweep)")
    p.add_argument("--sweep-table", default=None, help="with --sweep: also write the table as Markdown to this file")
    p.add_argument("--fragments", type=int, default=4, help="streaming fragments (default 4)")
    p.add_argument("--overlap-steps", type=int, default=None,
                   help="streaming: steps a sync is in flight (default: what auto picks for the link and a step "
                        "measured here first, 1.5x a fragment's modelled sync, at most H / 3; reported as overlap_rule)")
    p.add_argument("--merge", default=DiLoCoConfig().merge.value, choices=[m.value for m in OuterMerge],
                   help="Meridian's streaming: what a fragment becomes when its sync lands (default: the job's "
                        "default, mix, the paper's alpha-weighted merge; keep-progress: the outer result plus what "
                        "trained meanwhile)")
    p.add_argument("--mix-alpha", type=float, default=0.5,
                   help="streaming: local weight of the mix merge, Meridian's with --merge mix and torchft's (default 0.5)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (default 0.9)")
    p.add_argument("--diloco-warmup-steps", type=int, default=400,
                   help="Meridian's streaming DiLoCo: first inner steps on the short sync cycle, whole cycles (default 400)")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="inter-DC chunk size (default 1)")
    p.add_argument("--strategies", nargs="*", default=[],
                   help="run only these (har always runs; har-delayed, har-lookahead and har+bf16 run only when named)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-source", default=corpus.BUILTIN_PYTHON_REFERENCE,
                   help=f"the text every strategy trains on: {corpus.CHOICES_HELP}")
    p.add_argument("--data-max-bytes", type=int, default=DataConfig().max_bytes,
                   help=f"read at most this much of it (default {DataConfig().max_bytes:,})")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up after this long (default 3600)")
    p.add_argument("--lab", action="store_true",
                   help="run Meridian's strategies over meridian lab's real link (root; torchft's rows are skipped)")
    p.add_argument("--lock", default="/tmp/meridian-lab.lock", help="the machine's lab lock file (--lab)")
    p.add_argument("--lock-timeout-s", type=float, default=900.0, help="wait this long for the lab lock (--lab)")


def render(result: dict) -> str:
    head = (f"{result['model']} ({result['params']:,} params), {result['steps']} steps, link {result['link']['kind']} "
            f"{result['link']['rtt_ms']} ms / {result['link']['gbps']} Gbit/s, load {result['loadavg_before']}")
    rows = [head, f"{'strategy':<34}{'B/step':>12}{'x less':>9}{'val loss':>10}{'gap':>8}{'wall s':>9}{'util':>7}"]
    for name, r in result["strategies"].items():
        rows.append(f"{name:<34}{r['inter_dc_bytes_per_step']:>12,.0f}{r['bytes_reduction_vs_har']:>9.1f}"
                    f"{r['final_val_loss']:>10.4f}{r['loss_gap_vs_har']:>8.2%}{r['wall_s']:>9.1f}{r['compute_utilisation']:>7.1%}")
    a = result["auto_choice"]
    rows.append(f"auto: {a['strategy']} H={a['inner_steps']} {a['compression']} — {a['reason']}")
    if result.get("sweep"):
        rows.append(markdown_table(result["sweep"]))
    return "\n".join(rows)  # fmt: skip
