"""Decide where and how a job runs: a :class:`Plan` from a request, the cluster and its measured links.

Pure functions of their inputs (no Ray calls), so every decision is tested without a cluster. The
planner answers three questions:

1. Can the cluster *ever* hold this job? Otherwise :class:`Unschedulable` with the reason (e.g. "the model
   needs 92 GB per device with tp=1; tp=2 fits").
2. Which layout is fastest? It enumerates tensor-parallel sizes (never more than the devices of one node),
   pipeline depths (stages inside each datacenter, or stages spanning datacenters) and data-parallel sync
   strategies, estimates each with :mod:`meridian.service.planning.cost_model`, and keeps the fastest that fits,
   explaining what it beat and why.
3. Can it start *now*? (:func:`admission`, used by the queue.)

This module is the composition: feasibility here, the layouts in :mod:`~meridian.service.planning.candidates`,
where ranks go in :mod:`~meridian.service.planning.placement`, the words in
:mod:`~meridian.service.planning.explain`, the result a :class:`~meridian.service.planning.plan.Plan`. It must
never call Ray or read the clock.

What the layouts may use is a :class:`~meridian.service.planning.runtime_support.RuntimeSupport`: a job gets only
layouts today's runtime runs (``RUNTIME``); ``meridian plan --cluster`` also searches with every feature the cost
model knows, and such a plan is marked plan-only (:attr:`Plan.plan_only`), never offered to a job.

The principle from the product brief: bandwidth-hungry tensor parallelism stays inside a node, data and
pipeline parallelism may cross datacenters, and data-parallel gradients cross them hierarchically.
"""

from __future__ import annotations

from dataclasses import replace

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.errors import InvalidJob, Unschedulable
from meridian.service.jobs import JobRequest
from meridian.service.planning.buckets import MAX_BUCKET_MB, MIN_BUCKET_MB, TARGET_BUCKETS, buckets_of
from meridian.service.planning.candidates import Candidate, enumerate_candidates
from meridian.service.planning.cost_model import (
    Figures,
    Layout,
    collectives_per_step,
    estimate,
    grad_bytes_per_device,
    hierarchical_last_sync_mb,
    last_synced_bytes,
    lookahead_bytes,
    optimizer_share,
    runs_hierarchical,
    sync_pieces,
)
from meridian.service.planning.explain import (
    empty_datacenters_reason,
    explain,
    idle_nodes_reason,
    no_fit_in_memory_reason,
    no_layout_reason,
    summary_block,
    sync_reason,
    sync_why,
    too_few_workers_reason,
)
from meridian.service.planning.lowcomm_choice import choose_lowcomm
from meridian.service.planning.placement import (
    choose_datacenters,
    devices_per_dc,
    rank_placement,
    worker_resources,
    worker_slots,
    worker_unit,
)
from meridian.service.planning.plan import Plan
from meridian.service.planning.request import PlanRequest, plan_request
from meridian.service.planning.runtime_support import (
    EVERYTHING,
    RuntimeSupport,
    current_runtime,
    missing,
    missing_words,
)
from meridian.service.planning.sync_choice import MAX_SLOWDOWN, SyncChoice
from meridian.workers.contracts.config import (
    LOOKAHEAD_DECISION_STEPS,
    Compression,
    DiLoCoConfig,
    FsdpUnits,
    SyncStrategy,
    lookahead_decided_by,
    lookahead_start,
)


def plan_job(request: JobRequest | PlanRequest, topo: ClusterTopology, figures: Figures | None = None, *,
             runtime: RuntimeSupport | None = None) -> Plan:
    """The fastest layout this job can get on this cluster (raises if it can never fit). ``runtime``: the features
    the layouts may use; a plan made with more than :data:`~meridian.service.planning.runtime_support.RUNTIME`
    has may be plan-only (:attr:`Plan.plan_only`), which is never offered to a job."""
    return plan_with_layout(request, topo, figures, runtime=runtime)[0]


def plan_with_layout(request: JobRequest | PlanRequest, topo: ClusterTopology, figures: Figures | None = None, *,
                     runtime: RuntimeSupport | None = None) -> tuple[Plan, Candidate]:
    """:func:`plan_job`'s plan and the candidate layout it chose (its estimate as the plan reports it)."""
    request = plan_request(request)
    dcs = choose_datacenters(request, topo)
    use_gpu = topo.has_gpus(dcs)
    figures = figures or default_figures(topo, dcs, use_gpu)
    devices = devices_per_dc(request, topo, dcs, use_gpu)
    total = sum(sum(v) for v in devices.values())
    empty = [dc for dc in dcs if not devices[dc]]
    if empty and request.topology.datacenters is not None:
        raise Unschedulable(empty_datacenters_reason(empty, topo, worker_resources(use_gpu), named=True))
    cands = _layouts_for(request, dcs, devices, figures, worker_unit(use_gpu), runtime)
    fits = sorted((c for c in cands if not c.rejected), key=lambda c: (c.estimate.step_s, -c.layout.devices))
    if not fits:
        raise Unschedulable(no_fit_in_memory_reason(cands, figures) + _plan_only_fit(request, dcs, devices, figures,
                                                                                   runtime))
    # min_workers is a constraint on the layout, not a check of the fastest one: a slower layout that uses
    # enough workers is the plan when a faster one uses too few.
    feasible = [c for c in fits if c.layout.devices >= request.topology.min_workers]
    if not feasible:
        raise Unschedulable(too_few_workers_reason(request, fits, total, worker_unit(use_gpu)))
    best, choice = _diloco_override(request, feasible, figures)
    rank_dcs, rank_nodes = rank_placement(best, devices, {dc: list(topo.nodes_in(dc)) for dc in best.datacenters}, use_gpu)
    strategy, diloco, reason = _sync_for(request, best, choice)
    # an auto pick brings its inter-DC encoding (DiLoCo's outer deltas, or per-step sync in bf16), unless the
    # job asked for one
    picked = choice is not None and strategy is choice.strategy and choice.compression is not Compression.NONE
    compression = choice.compression if picked and request.sync.compression is Compression.NONE else None
    lookahead = choice is not None and strategy is choice.strategy and choice.local_lookahead
    armed = armed_lookahead(request, best, strategy, lookahead, figures)
    if armed is not None and not lookahead:
        checked = max(lookahead_start(request.sync.lookahead_after, request.warmup_steps), LOOKAHEAD_DECISION_STEPS)
        reason += " " + armed_reason(armed, checked, asked=request.sync.lookahead_when_exposed is not None)
    if lookahead:  # one step late, the sync hides behind the next step: what the estimate shows exposed changes
        assert choice is not None
        e = best.estimate
        best = replace(best, estimate=replace(e, exposed_dp_s=choice.har_exposed_s,
                                              step_s=e.step_s - e.exposed_dp_s + choice.har_exposed_s))
    # DDP's buckets are flat sync's alone: the hierarchical engine syncs per FSDP2 unit, DiLoCo per fragment
    flat = strategy is SyncStrategy.FLAT
    bucket_mb = best.layout.bucket_bytes / 2**20 if flat else None
    if best.layout.dp > 1 and not strategy.is_diloco:
        if not flat:
            reason += " " + unit_reason(request, best, figures)
        elif request.sync.bucket_mb is None:
            reason += " " + bucket_reason(request, best.layout)
    reason += unused_sync_knobs(request, strategy)
    if best.layout.fsdp and best.layout.pp == 1:
        reason += " " + gather_reason(request, best, figures)
    why = sync_why(strategy, requested=request.sync.strategy is not None, lay=best.layout, choice=choice)
    plan = Plan(
        datacenters=best.datacenters, rank_datacenters=rank_dcs, use_gpu=use_gpu, sync_strategy=strategy,
        explanation=explain(best, [c for c in feasible if c is not best], [c for c in cands if c.rejected],
                            worker_unit(use_gpu), fewer=[c for c in fits if c not in feasible],
                            min_workers=request.topology.min_workers)
        + idle_nodes_reason(topo, best.datacenters, use_gpu)
        + (empty_datacenters_reason(empty, topo, worker_resources(use_gpu), named=False) if empty else "") + reason,
        diloco=diloco, compression=compression, local_lookahead=lookahead, lookahead_when_exposed=armed,
        bucket_mb=bucket_mb, resources_per_worker=worker_resources(use_gpu),
        tp=best.layout.tp, pp=best.layout.pp,
        schedule="interleaved-1f1b" if best.layout.virtual_stages > 1 else best.layout.schedule,
        stages_span_dcs=best.layout.pp_spans_dcs, micro_batches=best.layout.micro_batches, rank_nodes=rank_nodes,
        micro_batch=best.layout.micro_batch, virtual_stages=best.layout.virtual_stages,
        sequence_parallel=best.layout.sequence_parallel, activation_checkpointing=best.layout.recompute.value,
        sharding="fsdp" if best.layout.fsdp else "optimizer" if best.layout.optimizer_sharded else "none",
        reshard_after_forward=best.layout.reshard_after_forward, fsdp_units=best.layout.fsdp_units.value,
        plan_only=best.plan_only,
        estimate={k: round(v, 6) for k, v in best.estimate.to_dict().items()},
        alternatives=tuple(c.summary() for c in sorted(cands, key=lambda c: (bool(c.rejected), c.estimate.step_s))[:8]),
        summary=summary_block(best, strategy=strategy, why=why, device_memory_bytes=figures.device_memory_bytes),
    )
    return plan, best


def _layouts_for(request: PlanRequest, dcs: tuple[str, ...], devices: dict[str, list[int]], figures: Figures,
                 unit: str, runtime: RuntimeSupport | None = None) -> list[Candidate]:
    """Every candidate layout the job may use here (memory not yet judged); raises if there is none."""
    total = sum(sum(v) for v in devices.values())
    if total == 0:
        raise Unschedulable(f"no worker fits in {', '.join(dcs)} (each worker needs one {unit})")
    dp_only = request.parallelism.is_data_parallel_only
    if request.topology.workers_per_datacenter is not None and total > request.global_batch and dp_only:
        raise InvalidJob(
            f"training.global_batch ({request.global_batch}) is smaller than the number of workers ({total}); "
            "every worker needs at least one sample per step"
        )
    every = enumerate_candidates(request, dcs, devices, figures, runtime)
    cands = every
    if request.topology.workers_per_datacenter is not None:
        # Explicit worker counts: use every requested device.
        cands = [c for c in every if c.layout.devices == total]
    if not cands:
        raise Unschedulable(no_layout_reason(request, devices, unit, every))
    return cands


def _plan_only_fit(request: PlanRequest, dcs: tuple[str, ...], devices: dict[str, list[int]], figures: Figures,
                   runtime: RuntimeSupport | None) -> str:
    """Where nothing the runtime runs fits: the sentence naming the fastest plan-only layout that would, and what
    it needs (empty when the search already had every feature, or nothing fits even so)."""
    if runtime is EVERYTHING:
        return ""
    fits = [c for c in enumerate_candidates(request, dcs, devices, figures, EVERYTHING) if not c.rejected]
    if not fits:
        return ""
    best = min(fits, key=lambda c: c.estimate.step_s)
    lacks = missing(best.layout, runtime or current_runtime(), tied_embeddings=request.shape.tie_embeddings)
    return (f". Plan-only, {best.name} would fit at {best.estimate.memory_bytes / 2**30:.1f} GB per device once the "
            f"runtime runs {missing_words(lacks)} (`meridian plan --cluster` shows such plans)")


def _diloco_override(request: PlanRequest, feasible: list[Candidate],
                     figures: Figures) -> tuple[Candidate, SyncChoice | None]:
    """The layout to run and, for a cross-datacenter data-parallel one, the sync choice that overrides the
    default strategy (per-step sync across DCs, or DiLoCo?). Only on a link that was measured or declared:
    on guessed figures the choice would be a guess too."""
    best = feasible[0]
    data_parallel = [c for c in feasible if c.layout.num_dcs > 1 and c.layout.pp == 1 and c.layout.tp == 1]
    if request.sync.strategy is not None or not figures.inter_dc_known or not data_parallel:
        return best, None
    dp = data_parallel[0]
    room = lookahead_fits(request, dp, figures)
    choice = choose_lowcomm(rtt_ms=figures.inter_dc.latency_s * 2000, gbps=figures.inter_dc.bytes_per_s * 8 / 1e9,
                         num_params=request.shape.num_params, compute_s=dp.estimate.compute_s,
                         num_dcs=dp.layout.num_dcs, overlap=request.sync.overlap,
                         # per-step sync as the engine overlaps it best (a unit per block); DiLoCo's fragments
                         # split the parameters whichever units FSDP2 has
                         last_sync_mb=hierarchical_last_sync_mb(request.shape),
                         steps=request.steps, lookahead=room,
                         lookahead_after=lookahead_start(request.sync.lookahead_after, request.warmup_steps),
                         optimizer_step_s=figures.step_overhead_s * optimizer_share(dp.layout),
                         micro_batches=dp.layout.micro_batches,
                         sparse=request.sync.compression is Compression.NONE)
    if choice.strategy.is_diloco:
        # DiLoCo hides the link behind H inner steps: it beats any per-step layout (a stage-spanning
        # pipeline included) when its compute plus the amortised outer sync is shorter.
        assert choice.diloco is not None
        if dp.estimate.compute_s + choice.outer_sync_s / choice.diloco.inner_steps < best.estimate.step_s:
            return dp, choice
        return best, None
    return best, choice if best is dp else None


def lookahead_fits(request: PlanRequest, cand: Candidate, figures: Figures) -> bool:
    """Whether a device holds the layout with the look-ahead's extra buffers as well
    (:func:`~meridian.service.planning.cost_model.lookahead_bytes`)."""
    return cand.estimate.memory_bytes + lookahead_bytes(request.shape, cand.layout) <= figures.device_memory_bytes


def armed_lookahead(request: PlanRequest, cand: Candidate, strategy: SyncStrategy, lookahead: bool,
                    figures: Figures) -> float | None:
    """``sync.lookahead_when_exposed`` for an ``auto`` job's plan, or ``None`` (the look-ahead set, or not run).

    Exact per-step sync across datacenters chosen on figures nobody measured (no link probe or declared link, or
    no compute probe of this model shape) is a guess: the job then arms the look-ahead at :data:`MAX_SLOWDOWN`
    (or the job's own ``sync.lookahead_when_exposed``), so its exact steps measure whether the sync is exposed,
    and if it is the look-ahead is tried and kept only if it steps faster
    (:mod:`meridian.workers.sync.lookahead_decision`). A look-ahead the planner chose stays armed only if the job
    asked for that. Never for a job too short for every check to be done (a trial included), with model
    parallelism, or where a device cannot hold its buffers."""
    asked = request.sync.lookahead_when_exposed
    if request.sync.strategy is not None:
        return None  # the job's own sync knobs pass through as they are
    if lookahead:
        return asked
    guessed = not (figures.inter_dc_known and figures.compute_known)
    first = lookahead_start(request.sync.lookahead_after, request.warmup_steps)
    lay = cand.layout
    fits = (strategy is SyncStrategy.HIERARCHICAL and lay.num_dcs > 1 and lay.tp == 1 and lay.pp == 1
            and request.steps >= lookahead_decided_by(first)
            and lookahead_fits(request, cand, figures))
    if not (fits and (guessed or asked is not None)):
        return None
    return asked if asked is not None else MAX_SLOWDOWN


def armed_reason(threshold: float, checked_at: int, *, asked: bool) -> str:
    why = "as the job asked" if asked else "the figures were not all measured"
    return (f"The look-ahead is armed ({why}): the exact steps before step {checked_at} measure how long each waits for the sync; if more than {threshold:.0%} of a step's "
            "compute, the look-ahead (one step late) is tried for a few steps and stays only if they were faster "
            "(a 'sync_decided' event says what was measured and chosen).")


def bucket_reason(request: PlanRequest, lay: Layout) -> str:
    """The sentence that says how big the planner made the gradient buckets, and why."""
    grads = grad_bytes_per_device(request.shape, lay.tp, lay.pp)
    n = buckets_of(grads, lay.bucket_bytes / 2**20)
    size = f"Gradient buckets of {lay.bucket_bytes / 2**20:.2f} MiB"
    limits = f"(aim {TARGET_BUCKETS}, none under {MIN_BUCKET_MB:g} or over {MAX_BUCKET_MB:g} MiB)"
    if n == 1:
        return (f"{size}: one holds the {grads / 2**20:.2f} MiB of gradients each device holds, so the sync follows "
                f"backward; smaller buckets would cost more than overlapping them saves {limits}.")
    return (f"{size}: about {n} for the {grads / 2**20:.2f} MiB of gradients each device holds, so the sync of all "
            f"but the last can overlap backward {limits}.")


def unit_reason(request: PlanRequest, best: Candidate, figures: Figures) -> str:
    """The sentence that says how the hierarchical engine cuts the sync so that backward hides it, and what it
    cannot hide."""
    lay = best.layout
    grads = grad_bytes_per_device(request.shape, lay.tp, lay.pp)
    last = last_synced_bytes(request.shape, lay)
    if lay.fsdp_units is FsdpUnits.MODEL:
        per_block = replace(lay, fsdp_units=FsdpUnits.BLOCK)
        est = estimate(request.shape, lay, figures, request.global_batch)  # per-step sync, as the choice compared
        est_block = estimate(request.shape, per_block, figures, request.global_batch)
        return (f"The whole model is one FSDP2 unit: {collectives_per_step(request.shape, lay)} data-parallel "
                f"collectives a step instead of {collectives_per_step(request.shape, per_block)} with a unit per "
                f"block, at about {figures.collective_s * 1e3:.2g} ms of fixed cost each here, which saves more than "
                f"overlapping the blocks' sync with backward would (estimated {est.step_s * 1e3:.1f} against "
                f"{est_block.step_s * 1e3:.1f} ms a step); the sync of the {grads / 2**20:.2f} MiB each device holds "
                "follows backward whole.")
    blocks = sync_pieces(request.shape, lay) - 1  # the units but the root
    return (f"Gradients sync per FSDP2 unit ({blocks} transformer block{'s' if blocks != 1 else ''}, then the "
            f"embeddings and head), each as soon as backward completes it, so only the last unit's sync "
            f"({last / 2**20:.2f} of the {grads / 2**20:.2f} MiB each device holds) necessarily follows backward.")


def gather_reason(request: PlanRequest, best: Candidate, figures: Figures) -> str:
    """The sentence that says how often FSDP gathers the weights a step, and why."""
    lay = best.layout
    m = lay.micro_batches
    held = f"the device holds them ({_size(best.estimate.memory_bytes)} of {_size(figures.device_memory_bytes)})"
    if lay.fsdp_units is FsdpUnits.MODEL:
        return f"FSDP gathers the model's weights once a step and keeps them until the step's last backward: {held}."
    if not lay.reshard_after_forward:
        return (f"FSDP keeps each block's weights gathered from the step's first forward to its last backward, so a "
                f"step gathers each once rather than {2 * m} times (in the forward and the backward of each of its "
                f"{m} micro-batch{'es' if m > 1 else ''}): {held}.")
    kept = estimate(request.shape, replace(lay, reshard_after_forward=False), figures, request.global_batch)
    return (f"FSDP frees each block's weights after its forward and gathers them again for backward, {2 * m} "
            f"gathers a step: keeping them gathered would need {_size(kept.memory_bytes)} per device, over the "
            f"{_size(figures.device_memory_bytes)} there.")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def unused_sync_knobs(request: PlanRequest, strategy: SyncStrategy) -> str:
    """For an ``auto`` job: the sentence naming the job's sync knobs the planned strategy does not use (empty when
    none). A job that names the strategy itself gets a 422 for them instead (the API's ``sync``)."""
    if strategy.is_diloco:
        unused = [name for name, set_ in (("sync.bucket_mb", request.sync.bucket_mb is not None),
                                          ("sync.overlap=false", not request.sync.overlap)) if set_]
        why = ("apply to per-step sync only: DiLoCo syncs each block inside the datacenter with FSDP2 and exchanges "
               "parameter deltas across datacenters every H steps, so it does not use them")
    elif strategy is SyncStrategy.HIERARCHICAL:
        unused = ["sync.bucket_mb"] if request.sync.bucket_mb is not None else []
        why = "sizes flat sync's DDP buckets only: the hierarchical engine syncs per FSDP2 unit, so it is not used"
    else:
        unused = []
    if not unused:
        return ""
    return f" {' and '.join(unused)} {why}."


def _sync_for(request: PlanRequest, best: Candidate,
              choice: SyncChoice | None) -> tuple[SyncStrategy, DiLoCoConfig | None, str]:
    """The sync strategy of the plan, its DiLoCo settings, and the sentence that says why."""
    strategy = request.sync.strategy or strategy_for(best.layout)
    reason = sync_reason(strategy, requested=request.sync.strategy is not None, num_dcs=best.layout.num_dcs,
                         pp=best.layout.pp, spans=best.layout.pp_spans_dcs, encoded=best.layout.encoded,
                         fsdp=best.layout.fsdp)
    diloco = request.sync.diloco if strategy.is_diloco else None
    if choice is not None and (choice.strategy.is_diloco or strategy is SyncStrategy.HIERARCHICAL):
        strategy, diloco, reason = choice.strategy, choice.diloco, " " + choice.explanation
    return strategy, diloco, reason


def strategy_for(lay: Layout) -> SyncStrategy:
    """The data-parallel engine that runs ``lay`` when the job leaves the choice to the planner."""
    # With pipeline stages the DP sync must be the hierarchical engine (DDP cannot follow a schedule);
    # inside one DC it is a reduce-scatter + all-gather, the same traffic as a ring all-reduce.
    return SyncStrategy.HIERARCHICAL if runs_hierarchical(lay) else SyncStrategy.FLAT


def ranked_layouts(
    request: JobRequest | PlanRequest, topo: ClusterTopology, figures: Figures
) -> list[tuple[Candidate, tuple[str, ...]]]:
    """Every layout that fits, fastest estimate first, with the datacenter of each rank: what
    ``meridian bench plan`` runs to check the estimates against measured step times."""
    request = plan_request(request)
    dcs = choose_datacenters(request, topo)
    use_gpu = topo.has_gpus(dcs)
    devices = devices_per_dc(request, topo, dcs, use_gpu)
    nodes = {dc: list(topo.nodes_in(dc)) for dc in dcs}
    return [(c, rank_placement(c, devices, nodes, use_gpu)[0]) for c in fitting_layouts(request, topo, figures)]


def fitting_layouts(request: JobRequest | PlanRequest, topo: ClusterTopology, figures: Figures, *,
                    runtime: RuntimeSupport | None = None) -> list[Candidate]:
    """Every layout with ``runtime``'s features that fits, fastest estimate first (no rank placed)."""
    request = plan_request(request)
    dcs = choose_datacenters(request, topo)
    devices = devices_per_dc(request, topo, dcs, topo.has_gpus(dcs))
    total = sum(sum(v) for v in devices.values())
    cands = [c for c in enumerate_candidates(request, dcs, devices, figures, runtime) if not c.rejected]
    if request.topology.workers_per_datacenter is not None:
        cands = [c for c in cands if c.layout.devices == total]
    return sorted(cands, key=lambda c: (c.estimate.step_s, -c.layout.devices))


CPU_COLLECTIVE_S = 2e-3
"""The fixed cost of one gloo collective on a CPU rank's training thread (:attr:`~meridian.service.planning.
cost_model.Figures.collective_s`)."""


def default_figures(topo: ClusterTopology, dcs: tuple[str, ...], use_gpu: bool) -> Figures:
    """Conservative figures when nothing was measured or declared (replaced by probe results when present)."""
    from meridian.service.planning.cost_model import Link

    nodes = [n for dc in dcs for n in topo.nodes_in(dc)]
    if use_gpu:
        memory, flops = 40 * 2**30, 100e12
    else:
        per_slot = [n.memory_bytes / max(1, worker_slots(n, use_gpu=False)) for n in nodes]
        memory, flops = (min(per_slot) if per_slot else 2**30), 5e9
    # a CPU collective over gloo costs milliseconds on the training thread (``meridian bench sync``'s FSDP2 rows:
    # the step time saved per collective dropped, docs/benchmarks/sync.md)
    return Figures(device_flops=flops, device_memory_bytes=memory, device_memory_known=not use_gpu,
                   bf16_autocast=use_gpu, collective_s=20e-6 if use_gpu else CPU_COLLECTIVE_S,
                   intra_node=Link(20e-6, 100e9 / 8), intra_dc=Link(50e-6, 25e9 / 8), inter_dc=Link(10e-3, 10e9 / 8))

