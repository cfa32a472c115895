"""Why a plan is what it is, in words: the explanation a plan carries and the reasons a job cannot run.

Text only, from decisions already made (the chosen candidate, the others, the sync strategy); nothing
here chooses anything, so changing a sentence never changes a plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.planning.candidates import Candidate
from meridian.service.planning.cost_model import Figures, Layout, Recompute
from meridian.service.planning.request import PlanRequest
from meridian.service.planning.runtime_support import missing_words
from meridian.service.planning.sync_choice import SyncChoice
from meridian.workers.contracts.config import Compression, SyncStrategy


def explain(best: Candidate, others: list[Candidate], rejected: list[Candidate], unit: str, *,
            fewer: Sequence[Candidate] = (), min_workers: int = 1) -> str:
    """``others``: the layouts the plan could have used, fastest first; ``fewer``: faster-or-not layouts left out
    because they use fewer than ``min_workers`` workers."""
    lay, e = best.layout, best.estimate
    where = _where(best)
    text = (f"{lay.devices} worker(s), one per {unit}: {best.name} ({where}); estimated {e.step_s * 1e3:.0f} ms/step, "
            f"{e.memory_bytes / 2**20:.0f} MiB per device, {e.inter_dc_bytes / 2**20:.1f} MiB across datacenters per step.")
    if others:
        nxt = others[0]
        text += f" Next best: {nxt.name} at {nxt.estimate.step_s * 1e3:.0f} ms/step ({_why_slower(best, nxt)})."
    faster = [c for c in fewer if c.estimate.step_s < e.step_s]
    if faster:
        f = faster[0]
        text += (f" Faster but left out: {f.name} at {f.estimate.step_s * 1e3:.0f} ms/step uses {f.layout.devices} "
                 f"worker(s), fewer than topology.min_workers={min_workers}.")
    if rejected:
        text += f" Rejected {len(rejected)} layout(s) that do not fit in memory (e.g. {rejected[0].name}: {rejected[0].rejected})."
    if best.plan_only:
        text += (f" Plan-only: this layout needs {missing_words(best.plan_only)}, which the runtime does not run yet "
                 "(service/planning/runtime_support.py), so no job is offered it.")
    return text


def _where(c: Candidate) -> str:
    """'2 replica(s) in dc-a, 1 replica(s) in dc-b' (or stages, when stages span datacenters)."""
    what = "stage(s)" if c.layout.pp_spans_dcs else "replica(s)"
    return ", ".join(f"{r} {what} in {dc}" for dc, r in zip(c.datacenters, c.replicas_per_dc, strict=True))


def _why_slower(best: Candidate, other: Candidate) -> str:
    a, b = best.estimate, other.estimate
    diffs = {
        "recomputation": b.recompute_s - a.recompute_s,
        "pipeline bubble and transfers": ((b.compute_s - b.recompute_s + b.pp_comm_s)
                                          - (a.compute_s - a.recompute_s + a.pp_comm_s)),
        "tensor-parallel all-reduces": b.tp_comm_s - a.tp_comm_s,
        "exposed gradient sync": b.exposed_dp_s - a.exposed_dp_s,
        "exposed FSDP collectives": b.fsdp_comm_s - a.fsdp_comm_s,
    }
    reason, delta = max(diffs.items(), key=lambda kv: kv[1])
    return f"+{_seconds(delta)} of {reason}" if delta > 0 else "slower overall"


def why_not(best: Candidate, other: Candidate) -> str:
    """Why the plan is ``best`` and not ``other`` (e.g. a published layout): how much faster, and the part of the
    step that makes most of the difference; or why ``other`` cannot run."""
    if other.rejected:
        return f"{other.name} does not fit: it {other.rejected}"
    a, b = best.estimate, other.estimate
    if b.step_s <= a.step_s:
        return f"{other.name} is as fast ({_seconds(b.step_s)} a step against {_seconds(a.step_s)})"
    gain = b.step_s / a.step_s - 1
    return (f"{best.name} is {gain:.1%} faster than {other.name} ({_seconds(a.step_s)} a step against "
            f"{_seconds(b.step_s)}): {_why_slower(best, other)}")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if abs(s) < 1 else f"{s:.2f} s"


def _memory(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _bytes(n: float) -> str:
    for factor, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n:.0f} B"


def summary_block(best: Candidate, *, strategy: SyncStrategy, why: str, device_memory_bytes: float) -> str:
    """The plan in at most eight lines: layout, memory per device, step time and its parts, throughput, inter-DC
    bytes, the sync strategy and why, and what a plan-only layout needs. The long reasoning is
    :func:`explain`'s."""
    lay, e = best.layout, best.estimate
    knobs = [f"micro-batch {lay.micro_batch} x {lay.micro_batches}"]
    knobs += [w for on, w in ((lay.virtual_stages > 1, f"{lay.virtual_stages} stages per device"),
                              (lay.sequence_parallel, "sequence parallel"), (lay.fsdp, "FSDP"),
                              (lay.recompute is not Recompute.NONE, f"{lay.recompute.value} recomputation"),
                              (lay.optimizer_sharded and not lay.fsdp, "optimizer state sharded")) if on]
    parts = [f"compute {_seconds(e.compute_s)}" + (f" (bubble {_seconds(e.bubble_s)})" if e.bubble_s else "")]
    parts += [f"{w} {_seconds(v)}" for w, v in (("tensor-parallel", e.tp_comm_s), ("pipeline", e.pp_comm_s),
                                                 ("exposed sync", e.exposed_dp_s), ("FSDP", e.fsdp_comm_s),
                                                 ("optimizer", e.optimizer_s)) if v > 0]
    lines = [
        f"layout      {best.name} ({_where(best)}); {', '.join(knobs)}",
        f"memory      {_memory(e.memory_bytes)} of {_memory(device_memory_bytes)} per device",
        f"step        {_seconds(e.step_s)}: {', '.join(parts)}",
        f"throughput  {e.tokens_per_s:,.0f} tokens/s" + (f", MFU {e.mfu:.1%}" if e.mfu else ""),
        f"inter-DC    {_bytes(e.inter_dc_bytes)} per step" if lay.num_dcs > 1 else "inter-DC    none (one datacenter)",
        f"sync        {strategy.value}: {why}",
    ]
    if best.plan_only:
        lines.append(f"plan-only   needs {missing_words(best.plan_only)}, which the runtime does not run yet")
    return "\n".join(lines)


def sync_why(strategy: SyncStrategy, *, requested: bool, lay: Layout, choice: SyncChoice | None) -> str:
    """Why the plan syncs with ``strategy``, in a few words (the long reason is in the explanation)."""
    if requested:
        return "as requested"
    if choice is not None and strategy is choice.strategy:
        if strategy.is_diloco:
            assert choice.diloco is not None
            return (f"per-step sync would leave {_seconds(choice.har_exposed_s)} of each step waiting for the link; "
                    f"an outer sync every {choice.diloco.inner_steps} steps instead")
        if choice.local_lookahead:
            return "one step late at a local look-ahead, the sync runs behind the next step"
        if choice.compression is not Compression.NONE:
            return f"per step, the inter-DC exchange in {choice.compression.value} to halve the bytes"
        return f"per step, {_seconds(choice.har_exposed_s)} of it not hidden behind backward"
    if lay.fsdp:
        return ("FSDP reduce-scatters the gradients inside each datacenter" +
                (", whose shards are then all-reduced across" if lay.num_dcs > 1 and not lay.pp_spans_dcs else ""))
    if lay.pp_spans_dcs:
        return "pipeline stages, not gradients, cross datacenters; each stage syncs inside its datacenter"
    if strategy is SyncStrategy.HIERARCHICAL and lay.num_dcs > 1:
        return "each datacenter's gradients cross the link once, the fewest inter-DC bytes"
    if strategy is SyncStrategy.HIERARCHICAL:
        return "pipeline stages need it; in one datacenter it moves what a flat all-reduce moves"
    if lay.num_dcs == 1:
        return "one datacenter, so a flat all-reduce is the shortest path"
    return "its estimated step beat hierarchical sync for this layout"


def sync_reason(strategy: SyncStrategy, *, requested: bool, num_dcs: int, pp: int = 1, spans: bool = True,
                encoded: bool = False, fsdp: bool = False) -> str:
    if requested:
        return f" Sync '{strategy.value}' (as requested)."
    if fsdp:
        across = (", its shards all-reduced across datacenters, and the parameters gathered per block as they "
                  "compute") if num_dcs > 1 and not spans else ", the parameters gathered per block as they compute"
        return f" Sync 'hierarchical' (chosen: FSDP reduce-scatters the gradients inside each datacenter{across})."
    if strategy is SyncStrategy.HIERARCHICAL and pp > 1 and num_dcs == 1:
        return (" Sync 'hierarchical' inside the datacenter (chosen: pipeline stages need it; in one datacenter "
                "it is a reduce-scatter + all-gather, the traffic of a flat all-reduce).")
    if strategy is SyncStrategy.HIERARCHICAL and encoded and num_dcs == 1:
        return (" Sync 'hierarchical' inside the datacenter (chosen: sync.compression applies to hierarchical sync "
                "only; with one datacenter no gradient crosses a datacenter link, so nothing is encoded; in one "
                "datacenter it is a reduce-scatter + all-gather, the traffic of a flat all-reduce).")
    if strategy is SyncStrategy.HIERARCHICAL:
        return (" Sync 'hierarchical' (chosen: reduce-scatter inside each datacenter, all-reduce of 1/N of the "
                "gradients across, all-gather inside).")
    if num_dcs == 1:
        return " Sync 'flat' (chosen: one datacenter, so a flat all-reduce is the shortest path)."
    if not spans:
        return " Sync 'flat' (chosen: its estimated step time beat hierarchical sync for this layout)."
    return " Sync 'flat' inside each datacenter (chosen: pipeline stages, not gradients, cross datacenters)."


def no_layout_reason(request: PlanRequest, devices: dict[str, list[int]], unit: str,
                     uncounted: Sequence[Candidate] = ()) -> str:
    """Why no (tp, pp, dp) layout exists, naming the option that rules them out where one does.
    ``uncounted``: the layouts left out only because they do not use every worker the request's
    ``topology.workers_per_datacenter`` asks for."""
    par = request.parallelism
    used = [dc for dc, v in devices.items() if v]
    total = sum(sum(v) for v in devices.values())
    if par.tp and all(s < par.tp for v in devices.values() for s in v):
        biggest = max((s for v in devices.values() for s in v), default=0)
        return f"parallelism.tp={par.tp} needs {par.tp} devices on one node; the largest node has {biggest} {unit} slot(s)"
    if par.pp and par.pp > 1 and request.sync.strategy is SyncStrategy.FLAT:
        return (f"parallelism.pp={par.pp} and sync.strategy 'flat' do not go together: flat sync (DDP) cannot follow "
                "a pipeline schedule; use sync.strategy 'hierarchical' (or 'auto'), or parallelism.pp=1")
    if par.stages_span_dcs and len(used) < 2:
        return (f"parallelism.stages_span_dcs=true puts pipeline stages in different datacenters, but the job's "
                f"workers can only be in {', '.join(used)}; give it two or more datacenters, or leave "
                "stages_span_dcs to the planner")
    if par.stages_span_dcs and par.pp and par.pp % len(used):
        return (f"parallelism.stages_span_dcs=true splits the pp={par.pp} stages evenly over the {len(used)} "
                f"datacenters with workers ({', '.join(used)}); use a pp that {len(used)} divides")
    if uncounted:
        closest = max(uncounted, key=lambda c: c.layout.devices)
        return (f"topology.workers_per_datacenter asks for {total} workers and the job must use them all, but no "
                f"(tp, pp, dp) layout of this model does; the closest uses {closest.layout.devices}: "
                f"{closest.name} ({_where(closest)}); change the counts or leave them to the planner")
    return (f"no (tp, pp, dp) layout of {request.shape.n_layers} layers / {request.shape.n_heads} heads fits "
            f"{total} workers with global_batch={request.global_batch}")


def idle_nodes_reason(topo: ClusterTopology, dcs: tuple[str, ...], use_gpu: bool) -> str:
    """The sentence that names the live nodes of a GPU job's datacenters that hold no worker (they have no GPU),
    so a CPU-only node left idle is a stated decision, not a surprise; empty when there is none."""
    idle = [n for dc in dcs for n in topo.nodes_in(dc) if n.gpus <= 0] if use_gpu else []
    if not idle:
        return ""
    names = ", ".join(f"{n.node_id} ({n.datacenter})" for n in idle)
    return f" No worker on {names}: no GPU, and each worker of a GPU job takes one."


def empty_datacenters_reason(empty: list[str], topo: ClusterTopology, per_worker: dict[str, float], *,
                             named: bool) -> str:
    """Why the datacenters in ``empty`` get no worker: none of their live nodes has what one worker takes.
    ``named``: the job listed them in ``topology.datacenters`` (a refusal: dropping them would run another
    layout than the one asked for); else a sentence of the plan's explanation ('auto' uses the others)."""
    each = " and ".join(f"{v:g} {r}" for r, v in per_worker.items())
    largest = "; ".join(
        f"{dc}: " + ", ".join(f"{n.node_id} has {n.cpus:g} CPU, {n.gpus:g} GPU" for n in topo.nodes_in(dc))
        for dc in empty)
    if named:
        return (f"topology.datacenters names {', '.join(empty)}, but no live node there can hold a worker (each "
                f"takes {each}; {largest}); add such a node or leave {', '.join(empty)} out of topology.datacenters")
    return f" No worker in {', '.join(empty)}: no live node there can hold one (each takes {each}; {largest})."


def too_few_workers_reason(request: PlanRequest, fits: list[Candidate], total: int, unit: str) -> str:
    """Why no layout that fits uses ``topology.min_workers`` workers: the cluster's (or the request's) worker
    count, or what caps the layouts below it (the global batch, the model's shape), and what to change."""
    need = request.topology.min_workers
    head = f"the job needs at least topology.min_workers={need} workers, but "
    if total < need:
        if request.topology.workers_per_datacenter is not None:
            return head + f"topology.workers_per_datacenter asks for {total}; ask for more or lower topology.min_workers"
        return (head + f"the datacenters it may use hold {total} (one per {unit} of their live nodes); add nodes or "
                "lower topology.min_workers")
    largest = max(fits, key=lambda c: c.layout.devices)
    lay, par = largest.layout, request.parallelism
    text = head + f"the largest layout that fits uses {lay.devices} of the {total} the cluster holds ({largest.name})"
    fixed = [f"parallelism.{k}={v}" for k, v in (("tp", par.tp), ("pp", par.pp)) if v]
    if lay.dp >= request.global_batch:
        more = f", leave {' and '.join(fixed)} to the planner (more workers per replica)" if fixed else ""
        return (text + f": every replica needs at least one sample per step, so training.global_batch="
                f"{request.global_batch} allows at most {lay.dp} replica(s), here of tp={lay.tp} x pp={lay.pp} "
                f"worker(s); raise training.global_batch{more} or lower topology.min_workers")
    return (text + ": no (tp, pp, dp) layout of this model uses more (tp divides its heads inside one node, pp its "
            f"{request.shape.n_layers} layers); lower topology.min_workers")


def no_fit_in_memory_reason(cands: list[Candidate], figures: Figures) -> str:
    """Why no candidate layout fits in device memory, with the smallest footprint and what to change."""
    smallest = min(cands, key=lambda c: c.estimate.memory_bytes)
    guessed = "" if figures.device_memory_known else (
        ", a guess: no GPU node's memory could be read; `meridian probe --compute` measures it")
    lay = smallest.layout
    gpipe = (f"parallelism.schedule '1f1b' (GPipe holds the activations of all {lay.micro_batches} micro-batches "
             f"at once, 1F1B at most {min(lay.pp, lay.micro_batches)}), "
             if lay.schedule == "gpipe" and lay.tp * lay.pp > 1 and lay.micro_batches > lay.pp else "")
    return (
        f"no layout fits in device memory ({figures.device_memory_bytes / 2**30:.1f} GB{guessed}): "
        + "; ".join(f"{c.name} {c.rejected.split(',')[0]}" for c in sorted(cands, key=lambda c: c.layout.tp)[:4])
        + f". The smallest footprint is {smallest.name} at {smallest.estimate.memory_bytes / 2**30:.1f} GB; "
        f"use {gpipe}a smaller model, a smaller micro_batch, or devices with more memory"
    )
