"""The layouts a job could run with: every (tp, pp, stages across datacenters, sync, and for the runtime's
features virtual stages, micro-batch, FSDP, sequence parallelism, recomputation) combination the cluster can hold,
each with its cost-model estimate and, if it cannot fit in device memory, why.

Pure: enumerating never raises and never chooses; :mod:`meridian.service.planning.planner` picks among the
candidates and :mod:`meridian.service.planning.explain` puts the choice into words. What the runtime cannot run
is never enumerated unless the caller asks for that runtime (:mod:`meridian.service.planning.runtime_support`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from meridian.service.planning.buckets import bucket_mb_for
from meridian.service.planning.cost_model import (
    Estimate,
    Figures,
    Layout,
    Recompute,
    estimate,
    grad_bytes_per_device,
    runs_hierarchical,
)
from meridian.service.planning.request import PlanRequest
from meridian.service.planning.runtime_support import RuntimeSupport, current_runtime, missing
from meridian.workers.contracts.config import (
    Compression,
    FsdpUnits,
    ParallelConfig,
    PipelineSchedule,
    Precision,
    SyncStrategy,
    check_model_parallel_sync,
)

TP_SIZES = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batch sizes searched where the request leaves it to the planner (offline plans)."""
MAX_VIRTUAL_STAGES = 8
"""The most pipeline stages per device interleaving is searched with."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    datacenters: tuple[str, ...]
    replicas_per_dc: tuple[int, ...]
    """Model replicas placed in each datacenter (stage-spanning layouts: stages per datacenter)."""
    estimate: Estimate
    rejected: str = ""
    plan_only: tuple[str, ...] = ()
    """The features this layout needs that today's runtime lacks (:data:`~meridian.service.planning.runtime_support.RUNTIME`);
    empty when a job can run it."""

    @property
    def name(self) -> str:
        lay = self.layout
        parts = [f"tp={lay.tp}", f"pp={lay.pp}" + (" across DCs" if lay.pp_spans_dcs else ""), f"dp={lay.dp}"]
        if lay.dp > 1 and not lay.pp_spans_dcs and lay.num_dcs > 1:
            parts.append("hierarchical" if lay.hierarchical else "flat")
        if lay.virtual_stages > 1:
            parts.append(f"v={lay.virtual_stages}")
        parts += [word for on, word in ((lay.sequence_parallel, "sp"), (lay.fsdp, "fsdp")) if on]
        if lay.recompute is not Recompute.NONE:
            parts.append(f"recompute={lay.recompute.value}")
        return " ".join(parts)

    def summary(self) -> dict[str, Any]:
        e, lay = self.estimate, self.layout
        return {"layout": self.name, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "virtual_stages": lay.virtual_stages,
                "micro_batch": lay.micro_batch, "stages_span_dcs": lay.pp_spans_dcs, "hierarchical": lay.hierarchical,
                "sequence_parallel": lay.sequence_parallel, "fsdp": lay.fsdp,
                "reshard_after_forward": lay.reshard_after_forward, "fsdp_units": lay.fsdp_units.value,
                "activation_checkpointing": lay.recompute.value,
                "est_step_s": round(e.step_s, 6), "memory_gb": round(e.memory_bytes / 2**30, 3),
                "inter_dc_bytes_per_step": int(e.inter_dc_bytes), "rejected": self.rejected,
                "plan_only": list(self.plan_only)}


def enumerate_candidates(request: PlanRequest, dcs: tuple[str, ...], devices: dict[str, list[int]],
                         figures: Figures, runtime: RuntimeSupport | None = None) -> list[Candidate]:
    """Every layout the cluster can run for this request with ``runtime``'s features, each with its estimate
    (unsorted).

    The order is tp, then pp, then stages-within / stages-across, then hierarchical before flat, then the
    runtime's knobs: the planner's stable sort keeps it among layouts with equal estimates. ``runtime``: default
    :data:`~meridian.service.planning.runtime_support.RUNTIME`."""
    runtime = runtime or current_runtime()
    tps, pps = _model_parallel_sizes(request, runtime)
    spans = (False, True) if request.parallelism.stages_span_dcs is None else (request.parallelism.stages_span_dcs,)
    used = tuple(dc for dc in dcs if devices[dc])
    one_node = all(len(devices[dc]) == 1 for dc in used)
    out: list[Candidate] = []
    for tp, pp, across in itertools.product(tps, pps, spans):
        if not _sync_runs_with(request, tp, pp):
            continue  # the workers refuse it (tensor/pipeline parallelism runs on FSDP2 under hierarchical sync)
        groups = {dc: sum(s // tp for s in devices[dc]) for dc in used}  # TP groups that fit per DC
        if not any(groups.values()):
            continue
        shape = _replicas(groups, used, pp, across, request.global_batch)
        if shape is None:
            continue
        dcs_here, replicas, dp = shape
        for hierarchical in _sync_options(request, across=across, num_dcs=len(dcs_here), pp=pp, tp=tp):
            base = _layout(request, figures, runtime, tp=tp, pp=pp, dp=dp, across=across, dcs=dcs_here,
                           replicas=replicas, hierarchical=hierarchical, dp_in_node=one_node)
            for lay in _variants(request, runtime, base):
                out.append(_candidate(request, figures, runtime, lay, dcs_here, replicas))
    return out


def _model_parallel_sizes(request: PlanRequest, runtime: RuntimeSupport | None = None) -> tuple[list[int], list[int]]:
    """Tensor-parallel sizes that divide the model's heads and MLP width, and pipeline depths that divide
    its layers, up to one layer per stage (or what the request fixed). A job that asks for periodic checkpoints is
    left ``tp = pp = 1`` where it leaves them to the planner: only a data-parallel job writes checkpoints it can
    resume from. A tied head stays on one stage unless the runtime keeps it across stages."""
    shape, par, runtime = request.shape, request.parallelism, runtime or current_runtime()
    if request.checkpoint_every:
        return [par.tp or 1], [par.pp or 1]
    tps = [par.tp] if par.tp else [t for t in TP_SIZES
                                   if shape.n_heads % t == 0 and shape.kv_heads % t == 0 and shape.ffn_hidden % t == 0]
    one_stage = shape.tie_embeddings and not runtime.tied_embeddings_across_stages
    pps = [par.pp] if par.pp else [1] if one_stage else _divisors(shape.n_layers, shape.n_layers)
    return tps, pps


def _replicas(groups: dict[str, int], used: tuple[str, ...], pp: int, across: bool,
              global_batch: int) -> tuple[tuple[str, ...], tuple[int, ...], int] | None:
    """(datacenters used, replicas — or stages — per datacenter, dp) of a layout, or ``None`` if it cannot run."""
    if across:
        if len(used) < 2 or pp % len(used):
            return None
        per_dc = pp // len(used)
        dp = min(groups[dc] // per_dc for dc in used)
        dcs_here, replicas = used, tuple(per_dc for _ in used)
    else:
        full = _shrink({dc: groups[dc] // pp for dc in used}, global_batch)
        dcs_here = tuple(dc for dc in used if full[dc] > 0)
        replicas = tuple(full[dc] for dc in dcs_here)
        dp = sum(replicas)
    if dp < 1 or dp > global_batch:
        return None
    return dcs_here, replicas, dp


def _sync_runs_with(request: PlanRequest, tp: int, pp: int) -> bool:
    """Whether the request's sync knobs can run with ``tp`` × ``pp`` (:func:`check_model_parallel_sync`)."""
    try:
        check_model_parallel_sync(ParallelConfig(tp=tp, pp=pp), request.sync)
    except ValueError:
        return False
    return True


def _sync_options(request: PlanRequest, *, across: bool, num_dcs: int, pp: int, tp: int = 1) -> list[bool]:
    """Hierarchical (``True``) and/or flat (``False``) data-parallel sync for a layout."""
    if request.sync.strategy is not None and not across and num_dcs > 1:
        return [request.sync.strategy is SyncStrategy.HIERARCHICAL]
    # tp or pp > 1 runs the hierarchical engine only (on FSDP2; DDP cannot follow a pipeline schedule), and so does
    # a job with an inter-DC encoding: flat sync has no inter-DC step to encode, and its config refuses
    # sync.compression
    only_hierarchical = (across or num_dcs == 1 or pp > 1 or tp > 1
                         or request.sync.compression is not Compression.NONE)
    return [True] if only_hierarchical else [True, False]


def bucket_mb(request: PlanRequest, *, tp: int, pp: int) -> float:
    """The job's ``sync.bucket_mb``, or the planner's size for the gradients one device of this layout holds."""
    if request.sync.bucket_mb is not None:
        return request.sync.bucket_mb
    return bucket_mb_for(grad_bytes_per_device(request.shape, tp, pp))


def _layout(request: PlanRequest, figures: Figures, runtime: RuntimeSupport, *, tp: int, pp: int, dp: int,
            across: bool, dcs: tuple[str, ...], replicas: tuple[int, ...], hierarchical: bool,
            dp_in_node: bool) -> Layout:
    """The layout with the request's micro-batch (or the smallest searched) and none of the runtime's knobs."""
    micro_batch = request.micro_batch or MICRO_BATCHES[0]
    fp32 = request.precision is Precision.FP32 or (request.precision is Precision.AUTO and not figures.bf16_autocast)
    return Layout(
        tp=tp, pp=pp, dp=dp, num_dcs=len(dcs), dp_per_dc=0 if across else min(replicas), pp_spans_dcs=across,
        micro_batch=micro_batch, micro_batches=_micro_batches(request, dp, micro_batch), hierarchical=hierarchical,
        overlap=request.sync.overlap,
        schedule="1f1b" if PipelineSchedule(request.parallelism.schedule) is PipelineSchedule.INTERLEAVED_1F1B
        else PipelineSchedule(request.parallelism.schedule).value, bucket_bytes=bucket_mb(request, tp=tp, pp=pp) * 2**20,
        fp32=fp32, encoded=request.sync.strategy is None and request.sync.compression is not Compression.NONE,
        sequence_parallel=tp > 1 and (runtime.sequence_parallel if request.parallelism.sequence_parallel is None
                                      else request.parallelism.sequence_parallel), bf16_weights=runtime.bf16_weights and not fp32,
        dp_in_node=dp_in_node,
    )


def _micro_batches(request: PlanRequest, dp: int, micro_batch: int) -> int:
    return max(1, -(-request.global_batch // dp // micro_batch))


def _variants(request: PlanRequest, runtime: RuntimeSupport, base: Layout) -> list[Layout]:
    """``base`` with each micro-batch size (where the request leaves it) and each number of virtual stages (where the
    request leaves it and the runtime interleaves), sharded the way the runtime shards it: a hierarchical layout
    with FSDP wherever the runtime has it (FSDP2 is how the hierarchical engine runs), else the optimizer state
    alone."""
    per_replica = -(-request.global_batch // base.dp)
    sizes = [request.micro_batch] if request.micro_batch else [b for b in MICRO_BATCHES if b <= per_replica] or [1]
    fsdp = runtime.fsdp and base.hierarchical and base.shards > 1
    asked = request.parallelism.virtual_stages
    interleaved = PipelineSchedule(request.parallelism.schedule) is PipelineSchedule.INTERLEAVED_1F1B
    out = []
    for b in sizes:
        m = _micro_batches(request, base.dp, b)
        virtual = [1]
        if base.pp > 1 and base.schedule == "1f1b" and runtime.interleaved_pipeline:
            layers = request.shape.n_layers // base.pp if request.shape.n_layers % base.pp == 0 else 1
            fitting = [v for v in range(2, min(layers, MAX_VIRTUAL_STAGES) + 1) if layers % v == 0 and m % base.pp == 0]
            virtual = ([] if interleaved else [1]) + fitting
        if asked is not None:
            virtual = [v for v in virtual if v == asked]
        for v in virtual:  # the cost model's 1F1B with virtual stages > 1 is interleaved 1F1B
            out.append(replace(base, micro_batch=b, micro_batches=m, virtual_stages=v, fsdp=fsdp))
    return out


def _candidate(request: PlanRequest, figures: Figures, runtime: RuntimeSupport, lay: Layout,
               dcs: tuple[str, ...], replicas: tuple[int, ...]) -> Candidate:
    """The layout's estimate with the least recomputation that fits (none, else full where the runtime
    recomputes: with fused attention, selective recomputation saves no memory), or why it does not fit."""
    if request.recompute is not None:
        lay = replace(lay, recompute=request.recompute)
    lay, est = _fastest_fsdp_setting(request, figures, lay)
    if (est.memory_bytes > figures.device_memory_bytes and runtime.activation_checkpointing
            and request.recompute is None):
        lay, est = _fastest_fsdp_setting(request, figures, replace(lay, recompute=Recompute.FULL))
    rejected = ""
    if est.memory_bytes > figures.device_memory_bytes:
        rejected = (f"needs {est.memory_bytes / 2**30:.1f} GB per device, "
                    f"devices have {figures.device_memory_bytes / 2**30:.1f} GB")
    return Candidate(lay, dcs, replicas, est, rejected, missing(lay, runtime, tied_embeddings=request.shape.tie_embeddings))


def _fastest_fsdp_setting(request: PlanRequest, figures: Figures, lay: Layout) -> tuple[Layout, Estimate]:
    """``lay`` with the fastest of the FSDP2 settings the planner chooses (its units, and whether blocks reshard
    after forward) among those that fit, else the one that needs the least memory. The hierarchical engine
    outside pipelines only: a unit per block kept gathered through the step, or resharded after forward (two
    gathers a micro-batch), or the whole model one unit (each collective's fixed cost paid once, nothing
    overlapped)."""
    if lay.pp > 1 or not runs_hierarchical(lay):
        return lay, estimate(request.shape, lay, figures, request.global_batch)
    options = [replace(lay, fsdp_units=units, reshard_after_forward=reshard) for units, reshard in
               ((FsdpUnits.BLOCK, False), (FsdpUnits.MODEL, False), (FsdpUnits.BLOCK, True))]
    rated = [(o, estimate(request.shape, o, figures, request.global_batch)) for o in options]
    fits = [r for r in rated if r[1].memory_bytes <= figures.device_memory_bytes]
    if fits:
        return min(fits, key=lambda r: r[1].step_s)
    return min(rated, key=lambda r: r[1].memory_bytes)


def _shrink(counts: dict[str, int], limit: int) -> dict[str, int]:
    """Remove replicas from the largest datacenter first until at most ``limit`` remain (every replica
    needs at least one sample per step)."""
    counts = dict(counts)
    while sum(counts.values()) > limit:
        biggest = max(counts, key=lambda dc: counts[dc])
        counts[biggest] -= 1
    return counts


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
